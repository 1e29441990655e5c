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
  inherit (lib) mkDefault mkEnableOption mkIf mkOption types;
  runner = cfg.droneRunnerService;
in
{
  options.services.ccci-run = {
    enable = mkEnableOption "ccci-run, the recipe-CI run supervisor, and its janitor";

    package = mkOption {
      type = types.package;
      default = pkgs.callPackage ./package.nix { };
      defaultText = lib.literalExpression "pkgs.callPackage ./package.nix { }";
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

    stateDir = mkOption {
      type = types.str;
      default = "/var/lib/ccci-run/state";
      description = "Run-scoped state files (a directory of its own, so the janitor can have a private /tmp).";
    };

    abraHome = mkOption {
      type = types.str;
      default = "/root/.abra";
      description = "The canonical abra directory (servers/, catalogue/, recipes/).";
    };

    docker = mkOption {
      type = types.enum [ "auto" "required" "off" ];
      default = "auto";
      description = ''
        Whether to touch Docker: auto (the built-in default everywhere) uses it when the engine
        answers and says so when it does not; required makes an unreachable engine an error.
      '';
    };

    etcdEndpoints = mkOption {
      type = types.listOf types.str;
      default = [ ];
      example = [ "http://10.0.0.1:2379" "http://10.0.0.2:2379" "http://10.0.0.3:2379" ];
      description = ''
        etcd endpoints shared by every runner host of one swarm: the app-domain and named locks
        become keys bound to leases, so runs of one domain on different hosts serialise and the
        janitor on any host tells a live run from a dead one. Empty: this host's flock.
      '';
    };

    leaseTtl = mkOption {
      type = types.ints.between 2 3600;
      default = 10;
      description = ''
        Seconds an etcd lease outlives its holder's last keepalive: how soon a dead host's
        domains free up, and how long etcd may be unreachable before a run counts its lock lost
        (exit 76).
      '';
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
        default = "/var/lib/prometheus/node-exporter/ccci-run.prom";
        description = ''
          Prometheus text file for node_exporter's textfile collector (enabled on that directory
          when set), or null.
        '';
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
      inherit (cfg) lockDir runsDir abraHome stateDir docker etcdEndpoints leaseTtl;
    };

    systemd.tmpfiles.rules = [
      "d ${cfg.runsDir} 0755 root root -"
      "d ${cfg.stateDir} 0700 root root -"
    ] ++ lib.optional (cfg.janitor.metricsFile != null)
      "d ${builtins.dirOf cfg.janitor.metricsFile} 0755 root root -";

    services.prometheus.exporters.node = mkIf (cfg.janitor.metricsFile != null) {
      enabledCollectors = [ "textfile" ];
      extraFlags = [ "--collector.textfile.directory=${builtins.dirOf cfg.janitor.metricsFile}" ];
    };

    systemd.services.ccci-run-janitor = {
      description = "ccci-run janitor: reap apps of dead recipe-CI runs";
      after = [ "docker.service" ];
      wants = [ "docker.service" ];
      restartTriggers = [ config.environment.etc."ccci-run/config.toml".source ];
      serviceConfig = helpers.janitorHardening {
        inherit (cfg) abraHome;
        network = cfg.etcdEndpoints != [ ];
        writablePaths = [ cfg.lockDir cfg.runsDir cfg.stateDir ]
          ++ lib.optional (cfg.janitor.metricsFile != null) (builtins.dirOf cfg.janitor.metricsFile);
      } // {
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
  (mkIf (runner != null) {
    assertions = [
      {
        assertion =
          let svc = config.systemd.services.${runner};
          in (svc.serviceConfig.ExecStart or null) != null || svc.script != "";
        message = ''
          services.ccci-run.droneRunnerService is "${runner}", but no such service runs anything
          on this host: name the Drone exec runner's unit, or set it to null.
        '';
      }
    ];
    # The runner's cgroup subtree is delegated, so each run (and each `ccci-run lock` command)
    # gets a cgroup of its own below it and its teardown ends every process with cgroup.kill.
    # A stop gives runs the time their teardown may take before systemd's SIGKILL.
    systemd.services.${runner}.serviceConfig = {
      Delegate = "yes";
      TimeoutStopSec = "6min";
    };
    # A default: a host that sets the capacity itself wins, rather than failing to evaluate.
    systemd.services.${runner}.environment = {
      DRONE_RUNNER_CAPACITY = mkDefault (toString cfg.runnerCapacity);
    };
  }) ]);
}
