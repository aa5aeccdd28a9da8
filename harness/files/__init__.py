"""Files on disk, the one way: names read from data become paths only through ``paths``, and every
writer writes through ``atomic`` (a unique temporary name, fsync, rename)."""
