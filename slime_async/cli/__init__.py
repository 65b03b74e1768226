"""CLI: the `slime-async` command (typer).

Owns: argument parsing, turning bad input into one clear error line with exit code 2, progress
output. Does not own: logic; each command calls into the part that does the work.
"""
