"""The algorithm library (package data: rldsl._algorithms)."""
