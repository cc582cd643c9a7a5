"""The frontend's streaming core, shared by both public APIs: tokenize, validate, admit, submit, and turn engine deltas into text."""
