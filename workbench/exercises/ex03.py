"""Notebook 03's exercises."""

EXERCISES: list = []
