# forgot the header
baseline      group_mean
