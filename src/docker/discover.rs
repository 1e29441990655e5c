//! Discovery: every run-app stack's resources, one list call per kind however many stacks there
//! are (counted, so tests can check). Labels decide: a resource belongs to stack S when it
//! carries the label `com.docker.stack.namespace=S`, whatever its name; only a resource with no
//! stack label (abra's external secrets) belongs to S by its name, and only by a name S's app
//! gives exactly (its recipe's secret, config, volume, network and service names under S, as
//! its runs recorded them: [`crate::names::GivenNames`]), never by a prefix another stack name
//! can extend (`S_example_org_…` is the app `….example.org`'s). Anything else named `S_…`
//! without a label is kept and reported ([`Kept`]), and so is everything unlabelled of an app
//! whose names nobody recorded. S maps back to a domain only through the run-app pattern, so
//! nothing outside the run-app namespace, and nothing labelled for another stack, is ever
//! touched.

use std::collections::{BTreeMap, BTreeSet, HashMap};

use bollard::errors::Error as BollardError;
use bollard::query_parameters::{
    ListConfigsOptions, ListContainersOptions, ListNetworksOptions, ListSecretsOptions,
    ListServicesOptions, ListVolumesOptions,
};

use crate::docker::seam::{
    DockerError, DockerSeam, GivenBy, Kept, Match, Resource, STACK_LABEL, StackResources,
};
use crate::names::{AppDomain, RunAppPattern};

impl DockerSeam {
    /// Every run-app stack's resources: one list call per kind.
    pub(crate) fn discover(
        &self,
        pattern: &RunAppPattern,
        given: GivenBy<'_>,
    ) -> Result<BTreeMap<AppDomain, StackResources>, DockerError> {
        self.runtime.block_on(self.list(pattern, given))
    }

    /// One list call per kind, sorted into run-app stacks.
    pub(super) async fn list(
        &self,
        pattern: &RunAppPattern,
        given: GivenBy<'_>,
    ) -> Result<BTreeMap<AppDomain, StackResources>, DockerError> {
        self.list_calls.set(self.list_calls.get() + 6);
        let d = &self.docker;
        let (services, containers, networks, volumes, secrets, configs) = tokio::join!(
            d.list_services(Some(ListServicesOptions::default())),
            d.list_containers(Some(ListContainersOptions {
                all: true,
                ..Default::default()
            })),
            d.list_networks(Some(ListNetworksOptions::default())),
            d.list_volumes(Some(ListVolumesOptions::default())),
            d.list_secrets(Some(ListSecretsOptions::default())),
            d.list_configs(Some(ListConfigsOptions::default())),
        );
        fn failed(kind: &'static str) -> impl Fn(BollardError) -> DockerError {
            move |e| DockerError(format!("failed to list {kind}: {e}"))
        }
        type Pick = (&'static str, fn(&mut StackResources) -> &mut Vec<Resource>);
        // Everything first: which stacks the engine knows by their labels decides what an
        // unlabelled name is.
        // Its labels, id, name, and where it goes.
        type Listed = (
            Option<HashMap<String, String>>,
            Option<String>,
            Option<String>,
            Pick,
        );
        let mut all: Vec<Listed> = Vec::new();
        for s in services.map_err(failed("services"))? {
            let spec = s.spec.unwrap_or_default();
            all.push((
                spec.labels,
                s.id,
                spec.name,
                ("service", |r| &mut r.services),
            ));
        }
        for c in containers.map_err(failed("containers"))? {
            let name = c.names.and_then(|n| n.into_iter().next());
            all.push((c.labels, c.id, name, ("container", |r| &mut r.containers)));
        }
        for n in networks.map_err(failed("networks"))? {
            all.push((n.labels, n.id, n.name, ("network", |r| &mut r.networks)));
        }
        for v in volumes
            .map_err(failed("volumes"))?
            .volumes
            .unwrap_or_default()
        {
            all.push((
                Some(v.labels),
                Some(v.name.clone()),
                Some(v.name),
                ("volume", |r| &mut r.volumes),
            ));
        }
        for s in secrets.map_err(failed("secrets"))? {
            let spec = s.spec.unwrap_or_default();
            all.push((spec.labels, s.id, spec.name, ("secret", |r| &mut r.secrets)));
        }
        for c in configs.map_err(failed("configs"))? {
            let spec = c.spec.unwrap_or_default();
            all.push((spec.labels, c.id, spec.name, ("config", |r| &mut r.configs)));
        }
        let labelled: BTreeSet<String> = all
            .iter()
            .filter_map(|(labels, ..)| labels.as_ref()?.get(STACK_LABEL).cloned())
            .collect();
        let mut found: BTreeMap<AppDomain, StackResources> = BTreeMap::new();
        let mut names_of: HashMap<AppDomain, Option<crate::names::GivenNames>> = HashMap::new();
        for (labels, id, name, (kind, pick)) in all {
            let (Some(id), Some(name)) = (id, name) else {
                continue;
            };
            let name = name.trim_start_matches('/').to_owned();
            // Labels decide: an object labelled for a stack is that stack's, whatever its
            // name (an app whose domain extends a run app's has names that begin with the run
            // app's stack).
            if let Some(stack) = labels.as_ref().and_then(|l| l.get(STACK_LABEL)) {
                if let Some(domain) = pattern.domain_of_stack(stack) {
                    pick(found.entry(domain).or_default()).push(Resource {
                        id,
                        name,
                        by: Match::Label,
                    });
                }
                continue;
            }
            // What carries no stack label goes by its name: exactly a name the app gives,
            // and one no longer stack the engine knows (`<run stack>_example_org`) begins.
            let Some(domain) = pattern.domain_of_resource(&name) else {
                continue;
            };
            let own = domain.stack_name();
            let extended = labelled.iter().find(|other| {
                other.len() > own.len()
                    && other.starts_with(&format!("{own}_"))
                    && name.starts_with(&format!("{other}_"))
            });
            let names = names_of
                .entry(domain.clone())
                .or_insert_with(|| given(&domain));
            let why = match (extended, names) {
                (Some(other), _) => Some(format!(
                    "no stack label, and the stack {other} the engine knows begins its name"
                )),
                (None, None) => Some(format!(
                    "no stack label, and no run of {domain} recorded the names its recipe \
                     gives: not provably its"
                )),
                (None, Some(names)) if !names.gives(kind, &name) => Some(format!(
                    "no stack label, and not a name the recipe of {domain} gives (another \
                     app's, whose domain extends it?)"
                )),
                (None, Some(_)) => None,
            };
            let stack = found.entry(domain).or_default();
            match why {
                Some(why) => stack.kept.push(Kept { kind, name, why }),
                None => pick(stack).push(Resource {
                    id,
                    name,
                    by: Match::Name,
                }),
            }
        }
        Ok(found)
    }
}
