.PHONY: run test install install-dev protos

run: install
	.venv/bin/kvmesh up --demo

test: install-dev
	scripts/test.sh

install:
	scripts/install.sh

install-dev:
	scripts/install.sh dev

protos:
	.venv/bin/python scripts/gen_protos.py
