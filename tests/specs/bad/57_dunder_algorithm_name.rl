algorithm __import__
  baseline      group_mean
