"""Formulas in specs: components written in mathematical notation inside a .rl file."""
