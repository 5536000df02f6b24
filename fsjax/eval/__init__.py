"""RULER-style evaluation: task generators, RULER file formats and scoring."""
