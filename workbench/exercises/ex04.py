"""Notebook 04's exercises."""

EXERCISES: list = []
