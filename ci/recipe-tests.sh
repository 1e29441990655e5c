#!/bin/sh
# What a recipe-CI run does inside ccci-run: deploy the recipe as this run's app, run the
# recipe's own tests against it, undeploy. ccci-run provides ABRA_DIR, the recipe checkout
# (CCCI_RECIPE_DIR), the app domain and the run-scoped state files; its teardown removes whatever
# is left of the app, however this script ends.
set -eu

server=${CCCI_SERVER:-default}
abra app new "$CCCI_RECIPE" --no-input --server "$server" --domain "$CCCI_APP_DOMAIN" --chaos
abra app deploy "$CCCI_APP_DOMAIN" --no-input --chaos
echo "$CCCI_APP_DOMAIN" >> "$CCCI_DEPLOYS_FILE"
# The deploy returns before swarm has converged (a rolling update can show N/N replicas while it
# is still going): the tests start only once every service of the run's stack (CCCI_STACK_NAME)
# runs and no update is in progress. A paused or rolled-back update, or no convergence within
# converge_timeout (CCCI_CONVERGE_TIMEOUT, the host's configuration file, 5m by default), fails
# the run here, naming the service and its task's error.
"${CCCI_BIN:-ccci-run}" converge

if [ -x "$CCCI_RECIPE_DIR/tests/run.sh" ]; then
  "$CCCI_RECIPE_DIR/tests/run.sh" "$CCCI_APP_DOMAIN"
fi

abra app undeploy "$CCCI_APP_DOMAIN" --no-input
