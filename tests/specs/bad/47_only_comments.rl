# an algorithm, some day
# nothing yet
