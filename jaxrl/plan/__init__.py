"""Planning a job before it runs: the programs a job compiles, built from shapes alone for a
target topology (`programs`), the hand counts of their FLOPs and bytes to set the compiled costs
against (`hand_count`), and the changes that make a program fit its devices (`fixes`)."""
