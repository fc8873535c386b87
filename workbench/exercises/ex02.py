"""Notebook 02's exercises."""

EXERCISES: list = []
