"""Autotuning of mate's tile configs (`mate-tune`, `python -m mate.tuning`); see mate/tuning/cli.py."""
