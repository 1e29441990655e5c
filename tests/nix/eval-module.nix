# nix/module.nix evaluated by the NixOS module system of a nixpkgs checkout, for
# tests/integration/nixos.rs. `hosts`: name -> the host's own module, each evaluated on a
# container-style host of its own. For each, what the tests compare: the units as systemd reads
# them, the configuration file, the runner's settings, the assertions that failed, the warnings.
{
  nixpkgs,
  hosts,
}:
let
  root = /. + nixpkgs;
  lib = import (root + "/lib");
  evaluate =
    host:
    let
      system = import (root + "/nixos/lib/eval-config.nix") {
        system = "x86_64-linux";
        modules = [
          ../../nix/module.nix
          {
            boot.isContainer = true;
            system.stateVersion = lib.trivial.release;
          }
          host
        ];
      };
      inherit (system) config;
      cfg = config.services.ccci-run;
      runner = if cfg.droneRunnerService == null then "drone-runner-exec" else cfg.droneRunnerService;
      unit = name: config.systemd.units.${name}.text or null;
      service = config.systemd.services.${runner} or null;
    in
    # Every option's value, checked against its type, before anything else is looked at.
    builtins.deepSeq (removeAttrs cfg [ "package" ]) {
      failedAssertions = map (a: a.message) (lib.filter (a: !a.assertion) config.assertions);
      inherit (config) warnings;
      janitorService = unit "ccci-run-janitor.service";
      janitorTimer = unit "ccci-run-janitor.timer";
      inherit runner;
      services = lib.attrNames config.systemd.services;
      runnerUnit = unit "${runner}.service";
      runnerEnvironment = if service == null then null else service.environment;
      runnerServiceConfig = if service == null then null else service.serviceConfig;
      runnerPath = if service == null then null else map lib.getName service.path;
      configToml = config.environment.etc."ccci-run/config.toml".text or null;
      tmpfiles = lib.filter (r: lib.hasInfix "ccci-run" r || lib.hasInfix "cc-ci-runs" r || lib.hasInfix "node-exporter" r) config.systemd.tmpfiles.rules;
      nodeExporter = config.systemd.services.prometheus-node-exporter.serviceConfig.ExecStart or null;
      package = if cfg.enable then cfg.package.name else null;
    };
in
lib.mapAttrs (_: evaluate) hosts
