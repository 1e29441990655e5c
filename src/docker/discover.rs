//! Discovery: every run-app stack's resources, one list call per kind however many stacks there
//! are (counted, so tests can check). Labels decide: a resource belongs to stack S when it
//! carries the label `com.docker.stack.namespace=S`, whatever its name; only a resource with no
//! stack label (abra's external secrets) belongs to S by its name, `S_…`. S maps back to a
//! domain only through the run-app pattern, so nothing outside the run-app namespace, and
//! nothing labelled for another stack, is ever touched.

use std::collections::BTreeSet;

use super::*;

impl DockerSeam {
    /// Every run-app stack's resources: one list call per kind.
    pub(crate) fn discover(
        &self,
        pattern: &RunAppPattern,
    ) -> Result<BTreeMap<AppDomain, StackResources>, DockerError> {
        self.runtime.block_on(self.list(pattern))
    }

    /// One list call per kind, sorted into run-app stacks.
    pub(super) async fn list(
        &self,
        pattern: &RunAppPattern,
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
        type Pick = fn(&mut StackResources) -> &mut Vec<Resource>;
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
            all.push((spec.labels, s.id, spec.name, |r| &mut r.services));
        }
        for c in containers.map_err(failed("containers"))? {
            let name = c.names.and_then(|n| n.into_iter().next());
            all.push((c.labels, c.id, name, |r| &mut r.containers));
        }
        for n in networks.map_err(failed("networks"))? {
            all.push((n.labels, n.id, n.name, |r| &mut r.networks));
        }
        for v in volumes
            .map_err(failed("volumes"))?
            .volumes
            .unwrap_or_default()
        {
            all.push((Some(v.labels), Some(v.name.clone()), Some(v.name), |r| {
                &mut r.volumes
            }));
        }
        for s in secrets.map_err(failed("secrets"))? {
            let spec = s.spec.unwrap_or_default();
            all.push((spec.labels, s.id, spec.name, |r| &mut r.secrets));
        }
        for c in configs.map_err(failed("configs"))? {
            let spec = c.spec.unwrap_or_default();
            all.push((spec.labels, c.id, spec.name, |r| &mut r.configs));
        }
        let labelled: BTreeSet<String> = all
            .iter()
            .filter_map(|(labels, ..)| labels.as_ref()?.get(STACK_LABEL).cloned())
            .collect();
        let mut found: BTreeMap<AppDomain, StackResources> = BTreeMap::new();
        for (labels, id, name, pick) in all {
            let (Some(id), Some(name)) = (id, name) else {
                continue;
            };
            let name = name.trim_start_matches('/').to_owned();
            // Labels decide: an object labelled for a stack is that stack's, whatever its
            // name (an app whose domain extends a run app's has names that begin with the run
            // app's stack). Only what carries no stack label goes by its name, and never by a
            // prefix another stack the engine knows extends: `<run stack>_example_org_…` is
            // the app `….example.org`'s while that app's stack is there.
            let (domain, by) = match labels.as_ref().and_then(|l| l.get(STACK_LABEL)) {
                Some(stack) => (pattern.domain_of_stack(stack), Match::Label),
                None => {
                    let domain = pattern.domain_of_resource(&name).filter(|domain| {
                        let own = domain.stack_name();
                        !labelled.iter().any(|other| {
                            other.len() > own.len()
                                && other.starts_with(&format!("{own}_"))
                                && name.starts_with(&format!("{other}_"))
                        })
                    });
                    (domain, Match::Name)
                }
            };
            let Some(domain) = domain else {
                continue;
            };
            pick(found.entry(domain).or_default()).push(Resource { id, name, by });
        }
        Ok(found)
    }
}
