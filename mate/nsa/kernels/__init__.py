"""TileLang programs of the NSA stages."""
