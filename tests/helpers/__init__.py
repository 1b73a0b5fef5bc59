"""Test helpers shared by the test suites: tiny GGUF writers and the float64 reference model.

Nothing here imports the native engine: these are the independent oracles it is tested against.
"""
