from taylor_tune.cli import run

run()
