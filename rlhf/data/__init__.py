"""Task data: schemas of every table, the reviews and TL;DR loaders, and the prepared-splits folder."""
