"""Notebook 01's exercises."""

EXERCISES: list = []
