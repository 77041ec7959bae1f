# helper for 35_parent_has_errors: a parent with two errors
algorithm broken_parent
  baseline      group_mena
  kl            k3
