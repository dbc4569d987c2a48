"""`hybridflow plan`: a cost model of every role per rank (memory, time, communication) and the search over
placements and parallel sizes built on it."""
