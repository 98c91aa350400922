from tqbench.cli.main import run

run()
