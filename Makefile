# hvd_compress: `make demo` and `make test` work on a fresh Debian machine (as root): both run
# `setup` first when the environment is missing or stale.
VENV      := .venv
PY        := $(VENV)/bin/python
STAMP     := $(VENV)/.hvdc-ready
SOURCES   := setup.py ci/setup.sh ci/requirements.txt $(shell find csrc -type f 2>/dev/null)
export PATH := $(CURDIR)/$(VENV)/bin:$(PATH)
export OMPI_MCA_rmaps_base_oversubscribe := 1

MPIRUN    := env HVDC_TWO_RANKS=1 mpirun --allow-run-as-root --oversubscribe -np 2 -x PATH -x HVDC_TWO_RANKS
HVDRUN    := env HVDC_TWO_RANKS=1 horovodrun --gloo -np 2 -H localhost:2
# A test's time limit from a watchdog thread: a rank blocked in a collective never returns to the
# interpreter, where pytest-timeout's default (a signal) would be handled; the thread prints every
# thread's stack and ends the rank, and the launcher the job.
PYTEST    := -m pytest -q -p no:cacheprovider --color=no --timeout=300 --timeout-method=thread
# No hang may outlive this: a stuck collective fails the run instead of stalling CI.
LIMIT     := timeout -k 20 1200

.PHONY: setup test test-unit test-parallel test-ranks test-ranks-all test-launcher test-elastic test-bench test-soak soak test-gpu demo bench bench-quick bench-gpu clean

setup:
	bash ci/setup.sh
	@touch $(STAMP)

$(STAMP): $(SOURCES)
	bash ci/setup.sh
	@touch $(STAMP)

test: $(STAMP) test-parallel test-ranks test-unit test-launcher test-elastic test-bench test-soak

# torch and TensorFlow suites run as separate jobs: Horovod's torch and TF libraries each keep
# their own global state and must not be loaded side by side in one process; TF1 graph mode
# (eager execution disabled for the whole process) has a job of its own. Each suite runs in full
# under the launcher where it is cheaper (torch: mpirun, 3x faster than Gloo's; TF: the same
# either way) and, under the other, each test function once (HVDC_FIRST_CASES, tests/conftest.py).
FIRST     := env HVDC_FIRST_CASES=1
test-parallel: $(STAMP)
	$(LIMIT) $(MPIRUN) $(PY) $(PYTEST) tests/parallel/test_torch_parallel.py tests/parallel/test_torch_amp.py
	$(LIMIT) $(FIRST) $(HVDRUN) $(PY) $(PYTEST) tests/parallel/test_torch_parallel.py tests/parallel/test_torch_amp.py
	$(LIMIT) $(HVDRUN) $(PY) $(PYTEST) tests/parallel/test_tf_parallel.py tests/parallel/test_tf_amp.py
	$(LIMIT) $(FIRST) $(MPIRUN) -x HVDC_FIRST_CASES $(PY) $(PYTEST) tests/parallel/test_tf_parallel.py tests/parallel/test_tf_amp.py
	$(LIMIT) $(HVDRUN) $(PY) $(PYTEST) tests/parallel/test_tf1_graph.py
	$(LIMIT) $(FIRST) $(MPIRUN) -x HVDC_FIRST_CASES $(PY) $(PYTEST) tests/parallel/test_tf1_graph.py

# The collective strategies at every rank count they must scale to (4 and 8 ranks oversubscribe
# the 2-core CI machine: the tensors are small and the steps few), one job per frontend and
# count: a rank's interpreter start (TensorFlow's import: 56 s for 8 ranks on 2 cores) is paid
# once for its two modules. Gloo at 2 ranks, where two ranks' equal payloads travel as a sum
# (collectives.pair_sum) that only these modules check against the simulation, and at an odd
# count; MPI at 4 and 8, and at 2 in test-parallel (`make test-ranks-all` runs both launchers
# at every count, every case).
RANKS     := 2:gloo 3:gloo 4:mpirun 8:mpirun
RANKS_ALL := 2:mpirun 2:gloo 3:mpirun 3:gloo 4:mpirun 4:gloo 8:mpirun 8:gloo
# The two-level strategy: 4 ranks that Horovod's Gloo mode takes for 2 nodes of 2 (tests/nodes.py).
NODE_TESTS := tests/parallel/test_torch_two_level.py tests/parallel/test_tf_two_level.py
# $(call RUN_RANKS,count:launcher ...,pattern): a module whose "count:file" matches the pattern
# runs each test function once (HVDC_FIRST_CASES). test-ranks does so at 8 ranks, where each
# rank has a quarter of a core, for the bucket modules (6 minutes in full), and for TensorFlow's
# modules at 2, 4 and 8 ranks (158 s in full at 4, 55 s once each): the reduction plan is the
# one both frontends share, and it runs in full at every count in test_torch_collectives.py
# and in TensorFlow at 3.
RUN_RANKS = for nl in $(1); do n=$${nl%%:*}; launcher=$${nl\#*:}; for f in torch tf; do \
	  mods="tests/parallel/test_$${f}_collectives.py tests/parallel/test_$${f}_buckets.py"; \
	  first=; for m in $$mods; do case "$$n:$${m\#\#*/}" in $(2)) \
	    first=$${first:+$$first,}$${m\#\#*/};; esac; done; \
	  echo "== $$mods at $$n ranks ($$launcher$${first:+; each test once in $$first})"; \
	  if [ $$launcher = mpirun ]; then \
	    $(LIMIT) env HVDC_RANKS=$$n HVDC_FIRST_CASES=$$first mpirun --allow-run-as-root \
	      --oversubscribe -np $$n -x PATH -x HVDC_RANKS -x HVDC_FIRST_CASES \
	      $(PY) $(PYTEST) $$mods || exit 1; \
	  else \
	    $(LIMIT) env HVDC_RANKS=$$n HVDC_FIRST_CASES=$$first horovodrun --gloo -np $$n \
	      -H localhost:$$n $(PY) $(PYTEST) $$mods || exit 1; \
	  fi; done; done
test-ranks: $(STAMP)
	@$(call RUN_RANKS,$(RANKS),8:*buckets.py|8:test_tf_collectives.py|[24]:test_tf_*)
	@for t in $(NODE_TESTS); do echo "== $$t as 2 nodes x 2 local ranks"; \
	  $(LIMIT) env HOROVOD_DYNAMIC_PROCESS_SETS=1 HVDC_NODES=1 $(PY) tests/nodes.py --nodes 2 \
	    --per-node 2 -- $(PY) $(PYTEST) $$t || exit 1; done

test-ranks-all: $(STAMP)
	@$(call RUN_RANKS,$(RANKS_ALL),none)

# Kernels run twice: on the AVX2 paths and on the portable scalar paths.
test-unit: $(STAMP)
	HVDC_FORCE_SCALAR=1 $(LIMIT) $(PY) $(PYTEST) tests/unit/test_kernels.py tests/unit/test_quantizers.py tests/unit/test_sparse.py tests/unit/test_homomorphic.py
	$(LIMIT) $(PY) $(PYTEST) tests/unit

# Unchanged Horovod scripts through `python -m hvd_compress` and HVD_COMPRESSION: the test starts
# its own 2-rank jobs under mpirun and horovodrun.
test-launcher: $(STAMP)
	$(LIMIT) $(PY) $(PYTEST) tests/launcher

# Resident memory stays flat with every stateful codec (a 1M-parameter model, 2 ranks, both
# frontends): `make soak` runs the full 2000 steps (about 10 minutes per frontend on 2 cores),
# `make test` a shortened run.
SOAK = for t in tests/soak/test_soak_torch.py tests/soak/test_soak_tf.py; do \
	  $(LIMIT) env HVDC_SOAK_STEPS=$(1) $(MPIRUN) -x HVDC_SOAK_STEPS $(PY) $(PYTEST) --timeout=1800 $$t \
	  || exit 1; done
test-soak: $(STAMP)
	@$(call SOAK,300)

soak: $(STAMP)
	@$(call SOAK,2000)

# Elastic Horovod (horovodrun --gloo, a discovery script on localhost): a worker killed and a slot
# added back; every rank holds the same weights and compression state after each reset.
test-elastic: $(STAMP)
	$(LIMIT) $(PY) $(PYTEST) tests/elastic

# The benchmark scripts end to end on tiny sizes (the network one needs root and namespaces);
# the slow ones in bench-quick.
test-bench: $(STAMP)
	$(LIMIT) $(PY) $(PYTEST) -m "not slow" tests/bench

# On a machine with a GPU and a CUDA build of torch (setup builds the CUDA kernels there): the
# CUDA kernels against the CPU ones, and their throughput. Not part of `make test`, which CI
# runs on CPU-only machines (where tests/unit compiles every .cu instead).
test-gpu: $(STAMP)
	$(PY) -c "import torch, sys; from hvd_compress.torch import _C; sys.exit(0 if torch.cuda.is_available() and _C.built_with_cuda() else 'test-gpu needs a CUDA device and the CUDA build')"
	$(LIMIT) $(PY) $(PYTEST) tests/gpu

bench-gpu: $(STAMP)
	$(PY) bench/codecs.py --device cuda
	$(PY) bench/device_step.py --device cuda
	$(PY) bench/device_step.py --device cuda --model transformer

demo: $(STAMP)
	$(PY) examples/demo.py

# Results (json, csv, png) go to docs/benchmarks; bench/network.py needs root.
bench: $(STAMP)
	$(PY) bench/codecs.py
	$(PY) bench/convergence.py
	$(PY) bench/convergence.py --model cnn --bucket-mb 1 --ef-only
	@for advised in "" --advised; do for model in "" "--model cnn --bucket-mb 1"; do \
	  $(PY) bench/convergence.py --momentum 0.9 --epochs 15 --ef-only $$advised $$model || exit 1; \
	done; done
	$(PY) bench/scaling.py
	$(PY) bench/tensors.py --bucket-mb 4
	$(PY) bench/reduction.py
	$(PY) bench/reduction.py --whole-step --rounds 24
	$(PY) bench/network.py
	$(PY) bench/network.py --layout 2x2
	$(PY) bench/network.py --model resnet50 --bucket-mb 4
	$(PY) bench/network.py --model transformer --bucket-mb 4 --steps 2
	$(PY) bench/network.py --model keras-resnet50 --bucket-mb 4 --steps 2
	$(PY) bench/cost_model.py
	$(PY) bench/device_step.py

bench-quick: $(STAMP)
	$(PY) bench/codecs.py --quick
	$(PY) bench/convergence.py --quick
	$(PY) bench/scaling.py --quick
	$(PY) bench/network.py --quick
	$(LIMIT) $(PY) $(PYTEST) -m slow tests/bench

clean:
	rm -rf build *.egg-info hvd_compress/torch/_C*.so
