"""Tools that are not benchmarks: the GPU check run on a lent GPU machine, and the builder of a committed data set."""
