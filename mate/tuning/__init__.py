"""Autotuning of mate's tile configs (`mate-tune`, `python -m tuning`); see tuning/cli.py."""
