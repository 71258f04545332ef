"""TileLang programs of the GQA / sliding-window attention stage."""
