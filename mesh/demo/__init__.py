"""`deltamesh demo`: the whole mesh on one machine (processes, live view, report) and the codec tour."""
