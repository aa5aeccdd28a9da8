"""Files on disk, the one way: names read from data become paths only through ``paths``, and every
writer writes through ``atomic`` (a unique temporary name, fsync, rename); a process's folders in the
system temp folder are made by ``scratch``, which removes them at exit and sweeps a killed process's."""
