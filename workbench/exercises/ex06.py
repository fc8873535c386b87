"""Notebook 06's exercises."""

EXERCISES: list = []
