# NixOS module: the janitor as a oneshot service on a timer, the shared directories, run-dir
# retention, metrics for node_exporter's textfile collector, and the one concurrency knob —
# the Drone exec runner's capacity.
{
  config,
  lib,
  pkgs,
  ...
}:

let
  cfg = config.services.ccci-run;
  helpers = import ./lib.nix;
  inherit (lib) mkEnableOption mkIf mkOption types;
in
{
  options.services.ccci-run = {
    enable = mkEnableOption "ccci-run, the recipe-CI run supervisor, and its janitor";

    package = mkOption {
      type = types.package;
      default = pkgs.callPackage ./package.nix { };
      description = "The ccci-run package.";
    };

    lockDir = mkOption {
      type = types.str;
      default = "/run/lock";
      description = "Where app-domain and named lock files live (tmpfs: a reboot empties it).";
    };

    runsDir = mkOption {
      type = types.str;
      default = "/var/lib/cc-ci-runs";
      description = "Per-run directories and run records.";
    };

    abraHome = mkOption {
      type = types.str;
      default = "/root/.abra";
      description = "The canonical abra directory (servers/, catalogue/, recipes/).";
    };

    docker = mkOption {
      type = types.enum [ "auto" "required" "off" ];
      default = "required";
      description = "Whether the janitor must reach Docker; on a CI host it should.";
    };

    janitor = {
      interval = mkOption {
        type = types.str;
        default = "10min";
        description = "How often the janitor sweeps (every run start sweeps too).";
      };
      longHeld = mkOption {
        type = types.ints.positive;
        default = 7200;
        description = "Seconds after which a held lock is flagged (never stolen).";
      };
      keepRunsDays = mkOption {
        type = types.nullOr types.ints.positive;
        default = 14;
        description = "Remove per-run directories older than this many days whose run is not live.";
      };
      metricsFile = mkOption {
        type = types.nullOr types.str;
        default = "/var/lib/prometheus-node-exporter-text-files/ccci-run.prom";
        description = "Prometheus text file for node_exporter's textfile collector, or null.";
      };
    };

    runnerCapacity = mkOption {
      type = types.ints.positive;
      default = 2;
      description = ''
        How many builds the Drone exec runner runs at once (DRONE_RUNNER_CAPACITY): the one
        concurrency knob.
      '';
    };

    droneRunnerService = mkOption {
      type = types.nullOr types.str;
      default = "drone-runner-exec";
      description = ''
        The systemd service of the Drone exec runner, which gets the capacity and the shared
        ccci-run environment; null leaves the runner alone.
      '';
    };
  };

  config = mkIf cfg.enable (lib.mkMerge [ {
    environment.systemPackages = [ cfg.package ];

    # One source of configuration for every ccci-run on the host.
    environment.etc."ccci-run/config.toml".text = helpers.configToml {
      inherit (cfg) lockDir runsDir abraHome docker;
    };

    systemd.tmpfiles.rules = [
      "d ${cfg.runsDir} 0755 root root -"
    ] ++ lib.optional (cfg.janitor.metricsFile != null)
      "d ${builtins.dirOf cfg.janitor.metricsFile} 0755 root root -";

    systemd.services.ccci-run-janitor = {
      description = "ccci-run janitor: reap apps of dead recipe-CI runs";
      after = [ "docker.service" ];
      wants = [ "docker.service" ];
      restartTriggers = [ config.environment.etc."ccci-run/config.toml".source ];
      serviceConfig = {
        Type = "oneshot";
        Nice = 10;
        ExecStart = lib.escapeShellArgs (
          [ (lib.getExe cfg.package) ]
          ++ helpers.janitorArgs {
            inherit (cfg.janitor) longHeld keepRunsDays metricsFile;
          }
        );
      };
    };

    systemd.timers.ccci-run-janitor = {
      wantedBy = [ "timers.target" ];
      timerConfig = {
        OnBootSec = "2min";
        OnUnitActiveSec = cfg.janitor.interval;
        AccuracySec = "30s";
      };
    };

  }
  (mkIf (cfg.droneRunnerService != null) {
    # The runner's cgroup subtree is delegated, so each run (and each `ccci-run lock` command)
    # gets a cgroup of its own below it and its teardown ends every process with cgroup.kill.
    # A stop gives runs the time their teardown may take before systemd's SIGKILL.
    systemd.services.${cfg.droneRunnerService}.serviceConfig = {
      Delegate = "yes";
      TimeoutStopSec = "6min";
    };
    systemd.services.${cfg.droneRunnerService}.environment = {
      DRONE_RUNNER_CAPACITY = toString cfg.runnerCapacity;
    };
  }) ]);
}
