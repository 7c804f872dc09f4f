"""Communication and time: interval algebra, overlap and exposed communication, volume and bandwidth,
step-time decomposition, cross-rank skew.  Pure functions of the events frame; times in µs."""
