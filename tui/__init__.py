"""The full-screen face of tqbench (Textual). It only consumes the engine under `tqbench/`; never the reverse."""
