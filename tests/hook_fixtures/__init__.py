"""Hook sets the tests enable by import path, in the test process and in real workers."""
