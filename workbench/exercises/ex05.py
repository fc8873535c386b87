"""Notebook 05's exercises."""

EXERCISES: list = []
