# NixOS module: the janitor as a oneshot service on a timer, the shared directories and
# /etc/ccci-run/config.toml, run-dir retention, metrics for node_exporter's textfile collector,
# and what the Drone exec runner's own unit needs (cgroup delegation, a stop timeout that covers
# a run's teardown, ccci-run on its PATH, and the one concurrency knob: its capacity).
#
# The runner's unit is the host's: every value the module gives it is an option default
# (mkOptionDefault), so whatever the host sets there wins, at any priority, and merges without a
# conflict. Where a host value would break ccci-run (no delegation, two capacities) an assertion
# says so and what to change; where it only weakens a guarantee (a short stop timeout) a warning.
{
  config,
  lib,
  options,
  pkgs,
  utils,
  ...
}:

let
  cfg = config.services.ccci-run;
  helpers = import ./lib.nix;
  inherit (helpers) defaults;
  inherit (lib)
    literalExpression
    mkIf
    mkOption
    mkOptionDefault
    types
    ;
  runner = cfg.droneRunnerService;
  runnerService = config.systemd.services.${runner};

  # An option type from one of lib.nix's rules: the rule's words are what an error names.
  ruleType =
    name: check: description:
    lib.mkOptionType {
      inherit name description;
      descriptionClass = "noun";
      check = v: builtins.isString v && check v;
      merge = lib.mergeEqualOption;
    };
  pathType = ruleType "ccci-run-path" helpers.isAbsolutePath helpers.absolutePathRule;
  ownDirType = ruleType "ccci-run-own-dir" helpers.isOwnDir helpers.ownDirRule;
  durationType =
    name: rule: ruleType "ccci-run-${name}" rule.check rule.description;
  # A whole number of seconds is still taken where one was before.
  secondsOr = t: types.coercedTo types.ints.unsigned toString t;

  settingOf = name: lib.findFirst (s: s.option == name) null helpers.runSettings;
  settingType = name: durationType name (settingOf name).rule;

  # What each run setting does; its key in config.toml and its rule come from lib.nix.
  settingDocs = {
    deadline = "The hard deadline of a whole run (`ccci-run run --deadline`; the binary's default is 1h).";
    killGrace = "How long a run's or a `lock` command's process group has between SIGTERM and SIGKILL (default 10s).";
    teardownTimeout = "How long the rest of a teardown (the hook, the app's removal) may take after the kill grace (default 5m).";
    lockWait = "How long a run waits for its app lock before it gives up with exit 75 (default: until its deadline).";
    longHeld = "After how long a held lock is flagged `long-held` by `ccci-run locks` and the janitor; never stolen (default 2h).";
    keepRuns = "How old a per-run directory whose run is not live must be before the janitor removes it; with a unit (\"14d\"). Unset: the janitor keeps every one unless told otherwise.";
    reapBudget = "How long the janitor's reap of one app may take on the Docker side before it is `reap-incomplete` (default 2m).";
    promoteAfter = "After how long a normal ticket of a named lock joins the fast class, keeping its place (default 20m).";
    convergeTimeout = "How long `ccci-run converge` waits for a deployed app's services to run (default 5m; 0 polls once); a recipe's `coop-cloud.<stack>.timeout` label is honoured where this is unset.";
    convergeStable = "How long a task must have been running for `ccci-run converge` to count it (default 1s).";
  };
  settingOption =
    name:
    mkOption {
      type = types.nullOr (settingType name);
      default = null;
      example = {
        deadline = "90m";
        killGrace = "15s";
        teardownTimeout = "10m";
        lockWait = "30m";
        longHeld = "3h";
        keepRuns = "30d";
        reapBudget = "5m";
        promoteAfter = "10m";
        convergeTimeout = "10m";
        convergeStable = "5s";
      }.${name};
      description = ''
        ${settingDocs.${name}} Written to /etc/ccci-run/config.toml as `${(settingOf name).key}`,
        which every ccci-run on the host reads (a flag or `CCCI_*` variable still overrides it
        for one invocation); null leaves the key out. Must be ${(settingOf name).rule.description}.
      '';
    };

  # The run settings that are set, by their key in the file.
  settings = lib.listToAttrs (
    map (s: lib.nameValuePair s.key cfg.${s.option}) (lib.filter (s: cfg.${s.option} != null) helpers.runSettings)
  );

  # The kill grace and the lease TTL in force, in whole seconds (rounded up).
  killGraceSecs = if cfg.killGrace == null then defaults.killGrace else helpers.durationSeconds cfg.killGrace;
  leaseTtlSecs = if builtins.isInt cfg.leaseTtl then cfg.leaseTtl else helpers.durationSeconds cfg.leaseTtl;

  # What a stop of the runner must leave its runs: their kill grace and teardown timeout.
  stopTimeout = helpers.stopTimeout {
    killGrace = if cfg.killGrace == null then defaults.killGrace else helpers.durationSeconds cfg.killGrace;
    teardownTimeout =
      if cfg.teardownTimeout == null then defaults.teardownTimeout else helpers.durationSeconds cfg.teardownTimeout;
  };

  metricsDir = if cfg.janitor.metricsFile == null then null else dirOf cfg.janitor.metricsFile;

  # node_exporter's textfile directories as the host's own definitions name them. The module's
  # definition is left out by its file name, so reading them cannot loop back into it.
  textfileModule = "${toString ./module.nix} (node_exporter's textfile directory)";
  hostTextfileDirs =
    let
      # services.prometheus.exporters is one option (a submodule): its definitions are sets
      # with `node` in them.
      defs = options.services.prometheus.exporters.definitionsWithLocations or [ ];
      # What a definition gives at `path` below it, through mkIf, mkMerge, mkOverride and
      # mkOrder at any level.
      valuesAt =
        path: v:
        if builtins.isAttrs v && v ? _type then
          if v._type == "if" then
            (if v.condition then valuesAt path v.content else [ ])
          else if v._type == "merge" then
            lib.concatMap (valuesAt path) v.contents
          else if v ? content then
            valuesAt path v.content
          else
            [ v ]
        else if path == [ ] then
          [ v ]
        else if builtins.isAttrs v && v ? ${lib.head path} then
          valuesAt (lib.tail path) v.${lib.head path}
        else
          [ ];
      flags = lib.concatMap (d: lib.concatLists (valuesAt [ "node" "extraFlags" ] d.value)) (
        lib.filter (d: d.file != textfileModule) defs
      );
    in
    lib.concatMap (
      f:
      let
        m = builtins.match "--collector[.]textfile[.]directory[= ](.*)" f;
      in
      if m == null then [ ] else [ (lib.head m) ]
    ) flags;

  # The runner's own configuration file, as far as this host declares it in Nix.
  runnerConfigFile = config.environment.etc."drone-runner-exec/config" or null;
  runnerConfigText = if runnerConfigFile == null then null else runnerConfigFile.text;
  fileCapacity =
    if runnerConfigText == null then
      null
    else
      let
        m = builtins.match "(.*\n)?[[:space:]]*(export[[:space:]]+)?DRONE_RUNNER_CAPACITY[[:space:]]*=[[:space:]]*['\"]?([^'\"\n]*).*" runnerConfigText;
      in
      if m == null then null else lib.elemAt m 2;
  # Whether the host set services.ccci-run.runnerCapacity itself, and the capacity its runner
  # unit has from anywhere but this module.
  capacityGiven = options.services.ccci-run.runnerCapacity.highestPrio < (mkOptionDefault null).priority;
  keepRunsGiven = options.services.ccci-run.janitor.keepRuns.highestPrio < (mkOptionDefault null).priority;
  capacityInUnit = if runner == null then null else runnerService.environment.DRONE_RUNNER_CAPACITY or null;
  # Whether the host's capacity lives in a file (the runner's own, or an EnvironmentFile=), or
  # in the unit's serviceConfig.Environment: the module then gives the unit none (two
  # Environment= lines would let the later win, silently).
  capacityInAFile = fileCapacity != null || envFileCapacities != [ ] || serviceEnvCapacities != [ ];
  # The user the runs run as: services.ccci-run.runnerUser, else the runner's unit's User=.
  unitUser = if runner == null then null else runnerService.serviceConfig.User or null;
  runnerUser =
    if cfg.runnerUser != null then cfg.runnerUser
    else if unitUser != null then unitUser
    else "root";
  # Its group as the host declares the user (users.users.<u>.group), never guessed from its name.
  declaredGroup = config.users.users.${runnerUser}.group or "";
  runnerGroup =
    if runnerUser == "root" then "root"
    else if runner != null && runnerService.serviceConfig ? Group then runnerService.serviceConfig.Group
    else if declaredGroup != "" then declaredGroup
    else runnerUser;
  dynamicRunner = runner != null && helpers.systemdTrue (runnerService.serviceConfig.DynamicUser or false);
  hostStop = if runner == null then null else runnerService.serviceConfig.TimeoutStopSec or null;
  hostStopNanos = if builtins.isString hostStop then helpers.timespanNanos hostStop else null;

  # The janitor reaches something over TCP: etcd, or a Docker engine at tcp://.
  network = cfg.etcdEndpoints != [ ] || (cfg.dockerHost != null && lib.hasPrefix "tcp://" cfg.dockerHost);

  # Where the runner's unit takes DRONE_RUNNER_CAPACITY from, and which place wins. systemd
  # reads EnvironmentFile= after Environment= (a file's value wins, the last file's of several);
  # the runner itself reads /etc/drone-runner-exec/config with godotenv, which never overrides
  # a variable already set (the unit's value wins).
  capacityIn =
    text:
    let
      m = builtins.match "(.*\n)?[[:space:]]*(export[[:space:]]+)?DRONE_RUNNER_CAPACITY[[:space:]]*=[[:space:]]*['\"]?([^'\"\n]*).*" text;
    in
    if m == null then null else lib.elemAt m 2;
  # An EnvironmentFile= the host declares in Nix (environment.etc with its text), or null.
  etcText =
    path:
    let
      entry = config.environment.etc.${lib.removePrefix "/etc/" path} or null;
    in
    if lib.hasPrefix "/etc/" path && entry != null then entry.text or null else null;
  runnerEnvFiles =
    if runner == null then
      [ ]
    else
      map (f: lib.removePrefix "-" (toString f)) (lib.toList (runnerService.serviceConfig.EnvironmentFile or [ ]));
  envFileCapacities = lib.concatMap (
    path:
    let
      text = etcText path;
      value = if text == null then null else capacityIn text;
    in
    lib.optional (value != null) { inherit path value; }
  ) runnerEnvFiles;
  unreadEnvFiles = lib.filter (path: etcText path == null) runnerEnvFiles;
  # DRONE_RUNNER_CAPACITY in the unit's serviceConfig.Environment (a string or a list of
  # `NAME=value` assignments, each maybe quoted), which systemd reads as Environment= lines.
  serviceEnvCapacities =
    if runner == null then
      [ ]
    else
      lib.concatMap (
        e:
        let
          m = builtins.match "[\"']?DRONE_RUNNER_CAPACITY=([^\"' ]*)[\"']?" (toString e);
        in
        lib.optional (m != null) (lib.head m)
      ) (lib.concatMap (e: lib.splitString " " (toString e)) (lib.toList (runnerService.serviceConfig.Environment or [ ])));
  # Whether the host defined DRONE_RUNNER_CAPACITY in the unit's environment itself.
  unitCapacityFromHost =
    runner != null
    && lib.any (
      d: d.file != toString ./module.nix && (d.value.${runner}.environment.DRONE_RUNNER_CAPACITY or null) != null
    ) (options.systemd.services.definitionsWithLocations or [ ]);
  # Every place that sets the capacity, in the order systemd and the runner read them: the last
  # place is the one in force.
  capacityPlaces =
    lib.optional (fileCapacity != null) {
      place = "DRONE_RUNNER_CAPACITY=${fileCapacity} in /etc/drone-runner-exec/config (the runner's own file, read with godotenv, which never overrides a variable already set)";
      value = fileCapacity;
    }
    ++ lib.optional (capacityGiven && cfg.runnerCapacity != null) {
      place = "services.ccci-run.runnerCapacity = ${toString cfg.runnerCapacity}";
      value = toString cfg.runnerCapacity;
    }
    ++ lib.optional unitCapacityFromHost {
      place = "DRONE_RUNNER_CAPACITY=${toString capacityInUnit} in systemd.services.${runner}.environment (the unit's Environment=)";
      value = toString capacityInUnit;
    }
    ++ map (value: {
      place = "DRONE_RUNNER_CAPACITY=${value} in systemd.services.${runner}.serviceConfig.Environment (an Environment= line of its own, after the unit's environment)";
      inherit value;
    }) serviceEnvCapacities
    ++ map (f: {
      place = "DRONE_RUNNER_CAPACITY=${f.value} in ${f.path} (the unit's EnvironmentFile=, which systemd reads after Environment=)";
      inherit (f) value;
    }) envFileCapacities;
  # The place in force: the last EnvironmentFile=, else the host's Environment=, else the
  # option (given to the unit only while no file sets a capacity), else the runner's file.
  capacityInForce =
    if envFileCapacities != [ ] || serviceEnvCapacities != [ ] then
      lib.last capacityPlaces
    else if unitCapacityFromHost then
      lib.findFirst (p: lib.hasInfix ".environment" p.place) null capacityPlaces
    else if capacityGiven && cfg.runnerCapacity != null && !capacityInAFile then
      lib.findFirst (p: lib.hasPrefix "services.ccci-run" p.place) null capacityPlaces
    else
      lib.head capacityPlaces;
  neededStopNanos = helpers.timespanNanos stopTimeout;
in
{
  imports = [
    # The flag for node_exporter, in a module of its own: see hostTextfileDirs.
    {
      _file = textfileModule;
      config = mkIf (cfg.enable && metricsDir != null) {
        # The flag when the host names no textfile directory of its own, else an empty word,
        # which the exporter's ExecStart joins as a space: the list's length must not depend
        # on the host's flags, or reading them would loop.
        services.prometheus.exporters.node.extraFlags = [
          (if hostTextfileDirs == [ ] then "--collector.textfile.directory=${metricsDir}" else "")
        ];
      };
    }
  ];

  options.services.ccci-run = {
    enable = lib.mkEnableOption "ccci-run, the recipe-CI run supervisor, and its janitor";

    package = mkOption {
      type = types.package;
      default = pkgs.callPackage ./package.nix { };
      defaultText = literalExpression "pkgs.callPackage ./package.nix { }";
      description = "The ccci-run package.";
    };

    lockDir = mkOption {
      type = ruleType "ccci-run-lock-dir" helpers.isLockDir helpers.lockDirRule;
      default = defaults.lockDir;
      description = ''
        Where app-domain and named lock files live; a tmpfs, so a reboot empties it. It must be
        writable by the runner's user: NixOS's /run/lock is root's (0755).
      '';
    };

    runsDir = mkOption {
      type = ownDirType;
      default = defaults.runsDir;
      description = "Per-run directories and run records (created for the runner's user).";
    };

    stateDir = mkOption {
      type = ownDirType;
      default = defaults.stateDir;
      description = "Run-scoped state files (a directory of its own, so the janitor can have a private /tmp).";
    };

    abraHome = mkOption {
      type = pathType;
      default = defaults.abraHome;
      description = "The canonical abra directory (servers/, catalogue/, recipes/).";
    };

    domainSuffix = mkOption {
      type = types.nullOr (ruleType "ccci-run-domain-suffix" helpers.isDomainSuffix helpers.domainSuffixRule);
      default = null;
      example = "ci.example.org";
      description = ''
        The domain every run app's domain ends in (`<recipe>-<hash>.<suffix>`); it must be
        ${helpers.domainSuffixRule}. Null: the binary's default, ci.commoninternet.net.
        Written as `domain_suffix`.
      '';
    };

    logFormat = mkOption {
      type = types.nullOr (types.enum [ "text" "json" ]);
      default = null;
      description = "How ccci-run writes its diagnostics on stderr. Null: text. Written as `log_format`.";
    };

    cgroup = mkOption {
      type = types.nullOr (types.enum [ "auto" "off" ]);
      default = null;
      description = ''
        Whether each run and `lock` command gets a cgroup of its own (auto: where cgroup v2 is
        writable, as below the runner's delegated unit) or never (off: process groups only).
        Null: auto. Written as `cgroup`.
      '';
    };

    recipeUrlTemplate = mkOption {
      type = types.nullOr (ruleType "ccci-run-recipe-url-template" helpers.isRecipeUrlTemplate helpers.recipeUrlTemplateRule);
      default = null;
      example = "https://git.example.org/coop-cloud/{recipe}.git";
      description = ''
        Where a run fetches its recipe from, {recipe} standing for its name. Null: the binary's
        default, https://git.coopcloud.tech/coop-cloud/{recipe}.git. It ends up in
        /etc/ccci-run/config.toml, which is world-readable (the Nix store too): put no
        credentials in it. Written as `recipe_url_template`.
      '';
    };

    docker = mkOption {
      type = types.enum [
        "auto"
        "required"
        "off"
      ];
      default = defaults.docker;
      description = ''
        Whether to touch Docker: auto (the built-in default everywhere) uses it when the engine
        answers and says so when it does not; required makes an unreachable engine an error.
      '';
    };

    etcdEndpoints = mkOption {
      type = types.listOf (ruleType "ccci-run-etcd-endpoint" helpers.isEndpoint helpers.endpointRule);
      default = [ ];
      example = [
        "http://10.0.0.1:2379"
        "http://10.0.0.2:2379"
        "http://10.0.0.3:2379"
      ];
      description = ''
        etcd endpoints shared by every runner host of one swarm: the app-domain and named locks
        become keys bound to leases, so runs of one domain on different hosts serialise and the
        janitor on any host tells a live run from a dead one. Empty: this host's flock.
      '';
    };

    leaseTtl = mkOption {
      type = secondsOr (durationType "lease-ttl" helpers.leaseTtlRule);
      default = defaults.leaseTtl;
      example = "15s";
      description = ''
        How long an etcd lease outlives its holder's last keepalive: how soon a dead host's
        domains free up, and how long etcd may be unreachable before a run counts its lock lost
        (exit 76). Must be ${helpers.leaseTtlRule.description}; a bare integer is taken as
        seconds. Written as `lease_ttl` when etcdEndpoints is set.
      '';
    };

    nodeSweepImage = mkOption {
      type = types.nullOr (types.strMatching "[^[:space:]]+");
      default = null;
      example = "docker:27-cli";
      description = ''
        On a swarm of several nodes: the image (with a docker CLI and sh) of the one-shot job
        that sweeps a reaped stack's containers and volumes off every node. It must be on every
        node, or pullable there. Null: the binary's default, docker:27-cli. Written as
        `node_sweep_image`.
      '';
    };

    dockerHost = mkOption {
      type = types.nullOr (types.strMatching "(unix:///|tcp://).*");
      default = null;
      example = "unix:///run/user/1000/docker.sock";
      description = ''
        The engine, in DOCKER_HOST's forms (unix:///PATH, tcp://HOST:PORT), when it is not at
        /var/run/docker.sock: a Drone step never sees the runner's DOCKER_HOST. A run's command
        gets it as its own DOCKER_HOST. Null: DOCKER_HOST where set, else the default socket.
        Written as `docker_host`.
      '';
    };

    dockerTlsVerify = mkOption {
      type = types.nullOr types.bool;
      default = null;
      description = ''
        With a tcp:// dockerHost: speak TLS and check the engine's certificate (the docker CLI's
        DOCKER_TLS_VERIFY). Null: no TLS. Written as `docker_tls_verify`.
      '';
    };

    dockerCertPath = mkOption {
      type = types.nullOr pathType;
      default = null;
      example = "/etc/ccci-run/docker-tls";
      description = ''
        With dockerTlsVerify: the directory of ca.pem, cert.pem and key.pem (the docker CLI's
        DOCKER_CERT_PATH). Null: ~/.docker of the user ccci-run runs as. Written as
        `docker_cert_path`.
      '';
    };

    nodeDockerSocket = mkOption {
      type = types.nullOr (types.strMatching "/.*");
      default = null;
      example = "/var/run/docker.sock";
      description = ''
        On a swarm of several nodes: where each node's engine socket is, the same path on every
        node (the sweep job bind-mounts it). Null: the binary's default, /var/run/docker.sock.
        Written as `node_docker_socket`.
      '';
    };

    deadline = settingOption "deadline";
    killGrace = settingOption "killGrace";
    teardownTimeout = settingOption "teardownTimeout";
    lockWait = settingOption "lockWait";
    longHeld = settingOption "longHeld";
    keepRuns = settingOption "keepRuns";
    reapBudget = settingOption "reapBudget";
    promoteAfter = settingOption "promoteAfter";
    convergeTimeout = settingOption "convergeTimeout";
    convergeStable = settingOption "convergeStable";

    janitor = {
      interval = mkOption {
        type = ruleType "ccci-run-interval" helpers.isInterval helpers.intervalRule;
        default = defaults.interval;
        description = "How often the janitor's timer sweeps (every run start sweeps too).";
      };
      longHeld = mkOption {
        type = secondsOr (settingType "longHeld");
        default = if cfg.longHeld == null then defaults.longHeld else cfg.longHeld;
        defaultText = literalExpression ''if longHeld == null then "${defaults.longHeld}" else longHeld'';
        description = ''
          The timer's `--long-held`: after how long a held lock is flagged (never stolen). Must
          be ${(settingOf "longHeld").rule.description}; a bare integer is seconds.
        '';
      };
      keepRuns = mkOption {
        type = types.nullOr (settingType "keepRuns");
        default =
          if cfg.janitor.keepRunsDays != null then
            "${toString cfg.janitor.keepRunsDays}d"
          else if cfg.keepRuns == null then
            defaults.keepRuns
          else
            cfg.keepRuns;
        defaultText = literalExpression ''if keepRuns == null then "${defaults.keepRuns}" else keepRuns'';
        description = ''
          The timer's `--keep-runs`: remove per-run directories older than this whose run is not
          live. Must be ${(settingOf "keepRuns").rule.description}. null passes no flag (the
          file's keep_runs applies, if set). Replaces janitor.keepRunsDays (N days is "Nd").
        '';
      };
      keepRunsDays = mkOption {
        type = types.nullOr (types.ints.between 1 36500);
        default = null;
        visible = false;
        description = "Replaced by janitor.keepRuns: N days is \"Nd\".";
      };
      metricsFile = mkOption {
        type = types.nullOr (ruleType "ccci-run-metrics-file" helpers.isMetricsFile helpers.metricsFileRule);
        default = defaults.metricsFile;
        description = ''
          Prometheus text file for node_exporter's textfile collector, or null. Written mode 0644
          whatever the umask, so node_exporter's own user reads it. The module points
          node_exporter's --collector.textfile.directory at its directory unless the host names
          one of its own (then put the file in one of those).
        '';
      };
    };

    runnerCapacity = mkOption {
      type = types.nullOr types.ints.positive;
      default = defaults.runnerCapacity;
      description = ''
        How many builds the Drone exec runner runs at once (DRONE_RUNNER_CAPACITY): the one
        concurrency knob. The module puts it in the runner's environment as a default, so a
        value the host sets there wins. The runner reads /etc/drone-runner-exec/config with
        godotenv, which never overrides a variable already set: a capacity kept in that file
        needs this set to null (the module refuses both at once when the file is declared in
        Nix with its text).
      '';
    };

    runnerUser = mkOption {
      type = types.nullOr types.str;
      default = null;
      example = "drone";
      description = ''
        The user the runner's runs run as; null takes the runner's unit's User= (root without
        one). The janitor runs as this user too, and the runs, state and lock dirs are its.
      '';
    };
    droneRunnerService = mkOption {
      type = types.nullOr (ruleType "ccci-run-service-name" helpers.isServiceName helpers.serviceNameRule);
      default = "drone-runner-exec";
      description = ''
        The systemd service of the Drone exec runner, which gets cgroup delegation, a stop
        timeout that covers a run's teardown, ccci-run and setsid on its PATH and the capacity;
        null leaves the runner alone.
      '';
    };
  };

  config = mkIf cfg.enable (
    lib.mkMerge [
      {
        environment.systemPackages = [ cfg.package ];

        # One source of configuration for every ccci-run on the host.
        environment.etc."ccci-run/config.toml".text = helpers.configToml {
          inherit (cfg)
            lockDir
            runsDir
            abraHome
            stateDir
            docker
            etcdEndpoints
            leaseTtl
            nodeSweepImage
            nodeDockerSocket
            dockerHost
            dockerTlsVerify
            dockerCertPath
            domainSuffix
            logFormat
            cgroup
            recipeUrlTemplate
            ;
          inherit settings;
          # An operator's root shell becomes the runner's user before it writes anything.
          runnerUser = if runnerUser == "root" then null else runnerUser;
        };

        # The runs dir and state dir are the runner's user's: every run writes there. A lock dir
        # of the host's choosing is too; /run/lock is the system's own.
        systemd.tmpfiles.rules = [
          "d ${cfg.runsDir} 0755 ${runnerUser} ${runnerGroup} -"
          "d ${cfg.stateDir} 0700 ${runnerUser} ${runnerGroup} -"
        ]
        ++ lib.optional (cfg.lockDir != defaults.lockDir) "d ${cfg.lockDir} 0755 ${runnerUser} ${runnerGroup} -"
        # The janitor writes the metrics as the runner's user.
        ++ lib.optional (metricsDir != null) "d ${metricsDir} 0755 ${runnerUser} ${runnerGroup} -";

        warnings =
          lib.optional (cfg.janitor.keepRunsDays != null && !keepRunsGiven) ''
            services.ccci-run.janitor.keepRunsDays is replaced by janitor.keepRuns: it is in force
            as janitor.keepRuns = "${toString cfg.janitor.keepRunsDays}d". Write that instead.
          ''
          ++ lib.optional (metricsDir != null && hostTextfileDirs != [ ] && !(lib.elem metricsDir hostTextfileDirs)) ''
            services.ccci-run.janitor.metricsFile is in ${metricsDir}, but node_exporter's
            textfile collector reads ${lib.concatStringsSep ", " hostTextfileDirs} (the host's
            --collector.textfile.directory): put the metrics file in one of those, or its
            alerts never see the janitor.
          ''
          ++ lib.optional
            (metricsDir != null && lib.elem "textfile" config.services.prometheus.exporters.node.disabledCollectors)
            ''
              services.ccci-run.janitor.metricsFile is set, but node_exporter's textfile collector is
              disabled (services.prometheus.exporters.node.disabledCollectors): nothing reads it.
            '';

        systemd.services.ccci-run-janitor = {
          description = "ccci-run janitor: reap apps of dead recipe-CI runs";
          documentation = helpers.documentation;
          after = [ "docker.service" ];
          wants = [ "docker.service" ];
          serviceConfig =
            helpers.janitorHardening {
              inherit (cfg) abraHome;
              inherit network;
              writablePaths = helpers.janitorWritablePaths {
                inherit (cfg) lockDir runsDir stateDir;
                inherit (cfg.janitor) metricsFile;
              };
            }
            // {
              Type = "oneshot";
              # One user runs the runs and sweeps them: what the janitor makes is the runner's.
              User = runnerUser;
              Nice = 10;
              ExecStart = utils.escapeSystemdExecArgs (
                [ (lib.getExe cfg.package) ]
                ++ helpers.janitorArgs {
                  inherit (cfg.janitor) longHeld keepRuns metricsFile;
                }
              );
            }
            // lib.optionalAttrs (runnerUser != "root") { Group = runnerGroup; };
        };

        assertions = [
          {
            assertion = cfg.runnerUser == null || runner == null
              || (if unitUser == null then "root" else unitUser) == cfg.runnerUser;
            message = ''
              services.ccci-run.runnerUser is ${toString cfg.runnerUser}, but
              systemd.services.${toString runner} runs as ${if unitUser == null then "root" else unitUser}:
              the runs would be one user's and the janitor another's. Set one user in both places.
            '';
          }
          {
            assertion = !dynamicRunner;
            message = ''
              systemd.services.${toString runner} has DynamicUser=true: its user exists only while
              it runs, so no directory can be made its own and the janitor cannot run as it. Give
              the runner a user of its own (users.users.drone, User = "drone",
              DynamicUser = false) and set services.ccci-run.runnerUser = "drone".
            '';
          }
          {
            assertion = runner != null || cfg.runnerUser != null;
            message = ''
              services.ccci-run.droneRunnerService is null, so the module cannot read which user
              the runner runs as: set services.ccci-run.runnerUser ("root" for a runner as root,
              else its own user), or name the runner's service.
            '';
          }
          {
            assertion = runnerUser == "root" || cfg.lockDir != defaults.lockDir;
            message = ''
              The runner runs as ${runnerUser}, which cannot create lock files in
              ${defaults.lockDir} (root's, 0755): set services.ccci-run.lockDir to a directory of
              its own, such as "/run/ccci-run" (the module creates it for that user).
            '';
          }
          {
            assertion = runnerUser == "root" || cfg.runsDir != (config.users.users.${runnerUser}.home or null);
            message = ''
              services.ccci-run.runsDir is ${cfg.runsDir}, the home of ${runnerUser}: the binary
              refuses a home as its runs dir. Set runsDir to a directory of its own, such as
              "/var/lib/cc-ci-runs".
            '';
          }
          {
            assertion = cfg.janitor.keepRunsDays == null || !keepRunsGiven;
            message = ''
              services.ccci-run.janitor.keepRunsDays (${toString cfg.janitor.keepRunsDays}) and
              janitor.keepRuns are both set: keepRunsDays is replaced by keepRuns. Remove it.
            '';
          }
          {
            assertion =
              (cfg.dockerTlsVerify == null && cfg.dockerCertPath == null)
              || (cfg.dockerHost != null && lib.hasPrefix "tcp://" cfg.dockerHost);
            message = ''
              services.ccci-run.dockerTlsVerify and dockerCertPath are for an engine reached over
              TCP, but dockerHost is ${if cfg.dockerHost == null then "not set" else cfg.dockerHost}:
              set dockerHost = "tcp://HOST:2376", or leave them null.
            '';
          }
          {
            # The binary refuses the same (exit 2): a holder must stop its command within its
            # lease, before etcd can expire it and another host takes the lock.
            assertion = cfg.etcdEndpoints == [ ] || killGraceSecs + 4 <= leaseTtlSecs;
            message = ''
              services.ccci-run.leaseTtl (${toString leaseTtlSecs} s) is too short for the kill
              grace (${toString killGraceSecs} s): a holder cut off from etcd must have stopped
              its command (the grace and 0.5 s for the kill) and kept 3.5 s for keepalives and
              an etcd leader election before etcd may expire its lease. Set leaseTtl to at
              least ${toString (killGraceSecs + 4)} s, or shorten killGrace.
            '';
          }
        ];

        systemd.timers.ccci-run-janitor = {
          description = "Run the ccci-run janitor periodically";
          documentation = helpers.documentation;
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
            assertion = (runnerService.serviceConfig.ExecStart or null) != null || runnerService.script != "";
            message = ''
              services.ccci-run.droneRunnerService is "${runner}", but systemd.services.${runner}
              starts nothing on this host (no serviceConfig.ExecStart, no script). Define the
              Drone exec runner's service there (for example ExecStart =
              "''${pkgs.drone-runner-exec}/bin/drone-runner-exec"), set droneRunnerService to the
              name of the host's runner service, or to null to leave the runner alone.
            '';
          }
          {
            assertion = helpers.delegates (runnerService.serviceConfig.Delegate or true);
            message = ''
              systemd.services.${runner}.serviceConfig.Delegate is ${builtins.toJSON runnerService.serviceConfig.Delegate},
              but ccci-run needs the runner's cgroup subtree delegated: each run gets a cgroup of
              its own below it, and its teardown ends every process the run started with
              cgroup.kill. Remove the host's Delegate setting, or set
              services.ccci-run.droneRunnerService = null to leave the runner alone.
            '';
          }
          {
            # One place for the capacity, whichever way the host sets it.
            assertion = lib.length capacityPlaces <= 1;
            message = ''
              The Drone runner's capacity is set in ${toString (lib.length capacityPlaces)} places:
              ${lib.concatMapStringsSep "; " (p: p.place) capacityPlaces}.
              The runner would run ${capacityInForce.value} builds at once, from
              ${capacityInForce.place}, and the rest would be silently ignored. Keep
              one: set services.ccci-run.runnerCapacity, or set it to null and keep the
              capacity in one file or in the unit's environment.
            '';
          }
        ];

        warnings =
          lib.optional (hostStopNanos != null && hostStopNanos < neededStopNanos) ''
            systemd.services.${runner}.serviceConfig.TimeoutStopSec is ${hostStop}, shorter than
            the ${stopTimeout} a run's teardown may take (its kill grace and teardown timeout):
            a stop of the runner can SIGKILL runs mid-teardown, leaving their apps to the
            janitor's next sweep.
          ''
          ++ lib.optional (capacityGiven && !capacityInAFile && unreadEnvFiles != [ ]) ''
            systemd.services.${runner} reads ${lib.concatStringsSep ", " unreadEnvFiles}
            (EnvironmentFile=), which this evaluation cannot read: a DRONE_RUNNER_CAPACITY there
            would win over services.ccci-run.runnerCapacity (${toString cfg.runnerCapacity}),
            since systemd reads EnvironmentFile= after Environment=. Keep the capacity in one
            place.
          ''
          ++ lib.optional (runnerUser != "root" && lib.hasPrefix "/root/" cfg.abraHome) ''
            systemd.services.${runner} runs as ${runnerUser}, which cannot read the abra home
            ${cfg.abraHome}: set services.ccci-run.abraHome to a directory that user can read.
          '';

        systemd.services = lib.optionalAttrs (runner != null) {
          ${runner} = {
          documentation = [ "man:ccci-run-run(1)" ];
          # The step script starts `setsid ccci-run run`; a Drone step's PATH is the runner's.
          path = [
            cfg.package
            pkgs.util-linux
          ];
          serviceConfig = {
            # The runner's cgroup subtree is delegated, so each run (and each `ccci-run lock`
            # command) gets a cgroup of its own below it and its teardown ends every process
            # with cgroup.kill.
            Delegate = mkOptionDefault true;
            # A stop gives runs the time their teardown may take before systemd's SIGKILL.
            TimeoutStopSec = mkOptionDefault stopTimeout;
          }
          # The user services.ccci-run.runnerUser names runs the runner too.
          // lib.optionalAttrs (cfg.runnerUser != null && cfg.runnerUser != "root") {
            User = lib.mkDefault cfg.runnerUser;
          };
          # Left out when the runner's own file sets the capacity: the file would lose.
          environment = lib.optionalAttrs (cfg.runnerCapacity != null && !capacityInAFile) {
            DRONE_RUNNER_CAPACITY = mkOptionDefault (toString cfg.runnerCapacity);
          };
          };
        };
      })
    ]
  );
}
