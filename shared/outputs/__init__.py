"""What both interpreters return and what reads it: the Trace with its one Chrome/Perfetto reader
and writer, and the overlap analysis of a measured trace."""
