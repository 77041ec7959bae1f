"""The rldsl grammar (package data: rldsl._grammar)."""
