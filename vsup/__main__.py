from vsup.cli.main import run

run()
