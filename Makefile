# The two commands the README starts with. Both set up .venv first (scripts/bootstrap.sh).
.PHONY: demo test setup
setup:
	@scripts/bootstrap.sh
demo: setup
	.venv/bin/zinf demo
test: setup
	.venv/bin/python -m pytest -q --durations=15
