"""Analyses of trained models beyond benchmark scores."""
