algorithm bom
  "A UTF-8 byte-order mark, as some editors write."
  baseline      group_mean
