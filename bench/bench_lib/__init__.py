"""What several bench/ scripts share (a package, so the benches' glob does not run it as a bench)."""
