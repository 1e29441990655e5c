# Pure helpers of the NixOS module: the host's defaults, the rule each option is checked by, the
# configuration file, the janitor's command line and sandbox. Free of nixpkgs, so that CI
# evaluates them on their own and compares them with systemd/, and the module builds its option
# types from the same rules.
let
  inherit (builtins)
    all
    any
    concatStringsSep
    elemAt
    filter
    foldl'
    fromJSON
    genList
    isList
    isString
    length
    match
    split
    stringLength
    substring
    toJSON
    ;

  # Larger than any bound below and far from overflowing a 64-bit integer when added to.
  tooLarge = 4611686018427387904;

  secondNs = 1000000000;

  # A string of decimal digits as an integer; leading zeros allowed, `tooLarge` past 18 digits.
  digits =
    s:
    let
      trimmed = match "0*([0-9]+)" s;
      d = if trimmed == null then s else elemAt trimmed 0;
    in
    if stringLength d > 18 then tooLarge else fromJSON d;

  # `n * unit`, or `tooLarge` when that would leave the range a bound can name.
  times = n: unit: if n > tooLarge / unit then tooLarge else n * unit;

  # Fraction digits as nanoseconds of one `unit`: "5" of a second is 500000000.
  fraction =
    ds: unit:
    let
      nine = substring 0 9 (ds + "000000000");
    in
    # Units of whole seconds (all but ms and us) first divided, so that nothing overflows.
    if unit >= secondNs then
      times (digits nine) (unit / secondNs)
    else
      times (digits nine) unit / secondNs;

  sum = foldl' (a: b: if a >= tooLarge - b then tooLarge else a + b) 0;

  # The units a ccci-run duration may be written in (src/duration.rs, UNITS), in nanoseconds:
  # milliseconds to weeks, nothing else (no months, no years, no spelled-out names).
  durationUnits = {
    ms = 1000000;
    s = secondNs;
    m = 60 * secondNs;
    h = 3600 * secondNs;
    d = 86400 * secondNs;
    w = 7 * 86400 * secondNs;
  };

  # The units of systemd.time(7) time spans, in nanoseconds.
  systemdUnits = rec {
    us = 1000;
    usec = us;
    ms = 1000000;
    msec = ms;
    s = secondNs;
    sec = s;
    second = s;
    seconds = s;
    m = 60 * s;
    min = m;
    minute = m;
    minutes = m;
    h = 3600 * s;
    hr = h;
    hour = h;
    hours = h;
    d = 86400 * s;
    day = d;
    days = d;
    w = 7 * d;
    week = w;
    weeks = w;
    M = 2630016 * s;
    month = M;
    months = M;
    y = 31557600 * s;
    year = y;
    years = y;
  };

  # `{ nanos; units; }` for a bare number of seconds ("90", "1.5") or a sequence of numbers with
  # units ("90s", "1h30m", "1h 30m"), else null. `fractions`: whether a number with a unit may
  # have a fractional part (systemd's spans and ccci-run's durations may: "1.5m").
  parseSpan =
    units: fractions: text:
    let
      bare = match "([0-9]+)(\\.([0-9]+))?" text;
      parts = split "([0-9]+)(\\.([0-9]+))? *([A-Za-z]+)" text;
      gaps = genList (i: elemAt parts (2 * i)) ((length parts + 1) / 2);
      pieces = filter isList parts;
      known = p: units ? ${elemAt p 3} && (fractions || elemAt p 2 == null);
      value =
        p:
        let
          unit = units.${elemAt p 3};
        in
        sum [
          (times (digits (elemAt p 0)) unit)
          (if elemAt p 2 == null then 0 else fraction (elemAt p 2) unit)
        ];
    in
    if !(isString text) then
      null
    else if bare != null then
      {
        nanos = sum [
          (times (digits (elemAt bare 0)) secondNs)
          (if elemAt bare 2 == null then 0 else fraction (elemAt bare 2) secondNs)
        ];
        units = false;
      }
    else if pieces != [ ] && all (g: match " *" g != null) gaps && all known pieces then
      {
        nanos = sum (map value pieces);
        units = true;
      }
    else
      null;

  # The binary's grammar (src/duration.rs): fractions with a unit too ("1.5m", "13.5s").
  nanosOf = text: (parseSpan durationUnits true text).nanos;
in
rec {
  # The host's settings when the module's options are left alone; systemd/ carries the same.
  defaults = {
    lockDir = "/run/lock";
    runsDir = "/var/lib/cc-ci-runs";
    stateDir = "/var/lib/ccci-run/state";
    abraHome = "/root/.abra";
    docker = "auto";
    metricsFile = "/var/lib/prometheus/node-exporter/ccci-run.prom";
    interval = "10min";
    longHeld = "2h";
    keepRuns = "14d";
    # Room for the default kill grace (10 s), the 0.5 s kill margin and 3.5 s of keepalives and
    # an etcd leader election.
    leaseTtl = "15s";
    runnerCapacity = 2;
    # The binary's own kill grace and teardown timeout, in seconds: what a stop of the runner
    # must leave a run.
    killGrace = 10;
    teardownTimeout = 300;
  };

  # An absolute, normalised path of plain characters: what the units (ReadWritePaths=,
  # tmpfiles lines) and the configuration file can carry without quoting, never "/" itself.
  isAbsolutePath =
    p:
    isString p
    && match "(/[A-Za-z0-9._@+,=:~-]+)+" p != null
    && match "(.*/)?[.][.]?(/.*)?" p == null;
  absolutePathRule = "an absolute path (not \"/\") of letters, digits and ._@+,=:~- without . or .. components, a trailing / or //";

  # Directories of the system or of everyone, the same list as the binary's (its runs dir
  # check, src/janitor/retention.rs): none is ever a directory of ccci-run's own. The module
  # would create it for the runner's user (a tmpfiles `d` line), changing its owner and mode.
  systemDirs = [
    "/" "/bin" "/boot" "/dev" "/dev/shm" "/etc" "/home" "/lib" "/lib32" "/lib64" "/libx32"
    "/lost+found" "/media" "/mnt" "/nix" "/nix/store" "/opt" "/root" "/run" "/run/lock"
    "/run/user" "/sbin" "/snap" "/srv" "/tmp" "/usr" "/usr/bin" "/usr/lib" "/usr/lib64"
    "/usr/libexec" "/usr/local" "/usr/local/bin" "/usr/local/lib" "/usr/local/sbin"
    "/usr/local/share" "/usr/sbin" "/usr/share" "/usr/src" "/var" "/var/backups" "/var/cache"
    "/var/lib" "/var/local" "/var/lock" "/var/log" "/var/mail" "/var/opt" "/var/run"
    "/var/spool" "/var/tmp" "/var/www"
  ];
  # Kernel file systems, and the temporary directories the janitor's unit gets private copies
  # of (PrivateTmp): nothing under them is shared with the runner or node_exporter.
  isUnder = dirs: p: any (d: p == d || substring 0 (stringLength d + 1) p == "${d}/") dirs;
  pseudoDirs = [ "/proc" "/sys" ];
  privateTmpDirs = [ "/tmp" "/var/tmp" ];

  # A directory ccci-run keeps for itself (runs, state): plain, absolute, not a system
  # directory, not under /proc, /sys or a private /tmp.
  isOwnDir =
    p: isAbsolutePath p && !(builtins.elem p systemDirs) && !(isUnder (pseudoDirs ++ privateTmpDirs) p);
  ownDirRule = "a directory of ccci-run's own: ${absolutePathRule}, not a system directory (/var/lib, /root, /tmp, /run, …) and not under /proc, /sys, /tmp or /var/tmp (the janitor's /tmp is private)";
  # The lock dir: /run/lock (the system's, which the module leaves alone), or one of its own.
  isLockDir = p: p == defaults.lockDir || isOwnDir p;
  lockDirRule = "/run/lock, or ${ownDirRule}";

  # The metrics file: node_exporter's textfile collector reads only *.prom files, from a
  # directory the module creates (so not a system one) and the janitor shares with it.
  isMetricsFile = p: isAbsolutePath p && match ".*/[^/]+[.]prom" p != null && isOwnDir (dirOf p);
  metricsFileRule = "an absolute path ending in .prom, in ${ownDirRule}";

  # A domain suffix as the binary takes it: DNS labels of a-z, 0-9 and -, at most 33
  # characters (its longest app domain, 12 characters and the suffix, is a stack name within
  # abra's 45).
  isDomainSuffix =
    v:
    isString v
    && stringLength v <= 33
    && match "[a-z0-9]([a-z0-9-]*[a-z0-9])?([.][a-z0-9]([a-z0-9-]*[a-z0-9])?)*" v != null;
  domainSuffixRule = "a domain suffix of lower-case DNS labels (a-z, 0-9, - inside a label) of at most 33 characters";

  # The recipe URL template: {recipe} where the recipe's name goes, no white space.
  isRecipeUrlTemplate = v: isString v && match "[^[:space:]]*[{]recipe[}][^[:space:]]*" v != null;
  recipeUrlTemplateRule = "a URL or path with {recipe} where the recipe's name goes and no white space, such as \"https://git.example.org/coop-cloud/{recipe}.git\"";

  # An etcd endpoint as the binary takes it: http://HOST:PORT (no TLS in this build), a port in
  # 1-65535.
  isEndpoint =
    e:
    let
      m = if isString e then match "http://(\\[[0-9A-Fa-f:.]+]|[A-Za-z0-9.-]+):([0-9]{1,5})/?" e else null;
      port = if m == null then 0 else digits (elemAt m 1);
    in
    m != null && port >= 1 && port <= 65535;
  endpointRule = "an etcd endpoint http://HOST:PORT with a port in 1-65535 (https:// is not supported)";

  # The runner's service as systemd.services names it: no ".service" suffix, no template.
  isServiceName = n: isString n && match "[A-Za-z0-9:_.-]+" n != null && match ".*[.]service" n == null;
  serviceNameRule = "the name of a systemd service as in systemd.services.<name> (letters, digits, :_.- and no .service suffix)";

  # A systemd time span (systemd.time(7)) longer than zero: the janitor timer's interval.
  timespanNanos = text: (parseSpan systemdUnits true text).nanos or null;
  # From a minute (a sweep may take that long) to a year (systemd ignores what overflows).
  isInterval =
    text:
    let
      n = timespanNanos text;
    in
    n != null && n >= 60 * secondNs && n <= 365 * 86400 * secondNs;
  intervalRule = "a systemd time span from 1min to 365d, such as \"10min\", \"1h 30min\" or \"600\"";

  # A ccci-run duration: a bare number of seconds ("90", "1.5") or numbers with units ("90s",
  # "5m", "1h30m", "14d", "2w"; ms to w), from `min` to `max` (themselves durations), in
  # whole milliseconds.
  # `unitRequired`: a bare number is refused. `wholeSeconds`: no fraction of a second.
  durationRule =
    {
      min,
      max,
      unitRequired ? false,
      wholeSeconds ? false,
    }:
    {
      check =
        text:
        let
          span = parseSpan durationUnits true text;
        in
        span != null
        && (span.units || !unitRequired)
        && span.nanos >= nanosOf min
        && span.nanos <= nanosOf max
        && span.nanos / 1000000 * 1000000 == span.nanos
        && (!wholeSeconds || span.nanos / secondNs * secondNs == span.nanos);
      description =
        "a duration from ${min} to ${max}"
        + (if wholeSeconds then " in whole seconds" else "")
        + (
          if unitRequired then
            " with a unit (\"12h\", \"14d\", \"2w\"; a bare number is refused: it used to mean days)"
          else
            " (seconds such as \"90\" or \"1.5\", or units such as \"90s\", \"5m\", \"1h30m\", \"14d\")"
        );
    };

  # The run settings of the configuration file: option name, key and the rule of its value.
  runSettings = [
    { option = "deadline"; key = "deadline"; rule = durationRule { min = "1s"; max = "365d"; }; }
    { option = "killGrace"; key = "kill_grace"; rule = durationRule { min = "0s"; max = "365d"; }; }
    { option = "teardownTimeout"; key = "teardown_timeout"; rule = durationRule { min = "1s"; max = "365d"; }; }
    { option = "lockWait"; key = "lock_wait"; rule = durationRule { min = "0s"; max = "365d"; }; }
    { option = "longHeld"; key = "long_held"; rule = durationRule { min = "0s"; max = "365d"; }; }
    { option = "keepRuns"; key = "keep_runs"; rule = durationRule { min = "1h"; max = "36500d"; unitRequired = true; }; }
    { option = "reapBudget"; key = "reap_budget"; rule = durationRule { min = "1s"; max = "365d"; }; }
    { option = "promoteAfter"; key = "promote_after"; rule = durationRule { min = "0s"; max = "365d"; }; }
    { option = "convergeTimeout"; key = "converge_timeout"; rule = durationRule { min = "0s"; max = "365d"; }; }
    { option = "convergeStable"; key = "converge_stable"; rule = durationRule { min = "0s"; max = "365d"; }; }
  ];
  # Every key of the configuration file and where the module takes it from: an option of
  # services.ccci-run (runner_user: runnerUser, else the runner's unit's User=).
  # docs/operations.md's table follows.
  fileKeys =
    [
      { key = "lock_dir"; option = "lockDir"; }
      { key = "runs_dir"; option = "runsDir"; }
      { key = "abra_home"; option = "abraHome"; }
      { key = "state_dir"; option = "stateDir"; }
      { key = "domain_suffix"; option = "domainSuffix"; }
      { key = "docker"; option = "docker"; }
      { key = "docker_host"; option = "dockerHost"; }
      { key = "docker_tls_verify"; option = "dockerTlsVerify"; }
      { key = "docker_cert_path"; option = "dockerCertPath"; }
      { key = "runner_user"; option = "runnerUser"; }
      { key = "log_format"; option = "logFormat"; }
      { key = "cgroup"; option = "cgroup"; }
      { key = "etcd_endpoints"; option = "etcdEndpoints"; }
      { key = "lease_ttl"; option = "leaseTtl"; }
      { key = "node_sweep_image"; option = "nodeSweepImage"; }
      { key = "node_docker_socket"; option = "nodeDockerSocket"; }
      { key = "recipe_url_template"; option = "recipeUrlTemplate"; }
    ]
    ++ map (s: { inherit (s) key option; }) runSettings;

  leaseTtlRule = durationRule { min = "2s"; max = "3600s"; wholeSeconds = true; };

  # Seconds (rounded up) of a ccci-run duration the rules above accepted.
  durationSeconds = text: (nanosOf text + secondNs - 1) / secondNs;
  # Milliseconds of a ccci-run duration the rules above accepted (the binary's own step).
  durationMillis = text: nanosOf text / 1000000;

  # What a stop of the runner must wait for before systemd's SIGKILL: a run's kill grace and
  # teardown timeout, and a margin for the janitor-like tidying at its end; in systemd's words.
  stopTimeout =
    { killGrace, teardownTimeout }:
    let
      secs = killGrace + teardownTimeout + 50;
    in
    if secs / 60 * 60 == secs then "${toString (secs / 60)}min" else "${toString secs}s";

  # The janitor's command line for the given settings (null leaves a flag out).
  janitorArgs =
    {
      longHeld,
      keepRuns,
      metricsFile,
    }:
    [ "janitor" ]
    ++ (if longHeld == null then [ ] else [ "--long-held" longHeld ])
    ++ (if keepRuns == null then [ ] else [ "--keep-runs" keepRuns ])
    ++ (if metricsFile == null then [ ] else [ "--metrics-file" metricsFile ]);

  # /etc/ccci-run/config.toml: the one place the host's settings are kept. Every ccci-run on the
  # host reads it (the Drone step, the janitor's timer, an operator's shell), so they cannot
  # drift. `settings`: file key -> duration (null leaves the key out: the binary's default).
  configToml =
    {
      lockDir,
      runsDir,
      abraHome,
      stateDir,
      docker,
      etcdEndpoints ? [ ],
      leaseTtl ? defaults.leaseTtl,
      nodeSweepImage ? null,
      nodeDockerSocket ? null,
      dockerHost ? null,
      dockerTlsVerify ? null,
      dockerCertPath ? null,
      runnerUser ? null,
      domainSuffix ? null,
      logFormat ? null,
      cgroup ? null,
      recipeUrlTemplate ? null,
      settings ? { },
    }:
    let
      line = key: value: "${key} = ${toJSON value}\n";
      set = map (s: s.key) (filter (s: (settings.${s.key} or null) != null) runSettings);
    in
    "# Written by the NixOS module services.ccci-run; `ccci-run config` shows what is in force.\n"
    + line "lock_dir" lockDir
    + line "runs_dir" runsDir
    + line "abra_home" abraHome
    + line "state_dir" stateDir
    + line "docker" docker
    + (if dockerHost == null then "" else line "docker_host" dockerHost)
    + (if dockerTlsVerify == null then "" else line "docker_tls_verify" dockerTlsVerify)
    + (if dockerCertPath == null then "" else line "docker_cert_path" dockerCertPath)
    + (if runnerUser == null then "" else line "runner_user" runnerUser)
    + (if domainSuffix == null then "" else line "domain_suffix" domainSuffix)
    + (if logFormat == null then "" else line "log_format" logFormat)
    + (if cgroup == null then "" else line "cgroup" cgroup)
    + (if recipeUrlTemplate == null then "" else line "recipe_url_template" recipeUrlTemplate)
    + (if nodeSweepImage == null then "" else line "node_sweep_image" nodeSweepImage)
    + (if nodeDockerSocket == null then "" else line "node_docker_socket" nodeDockerSocket)
    + concatStringsSep "" (map (key: line key settings.${key}) set)
    + (
      if etcdEndpoints == [ ] then
        ""
      else
        "etcd_endpoints = [ ${concatStringsSep ", " (map toJSON etcdEndpoints)} ]\n"
        + line "lease_ttl" leaseTtl
    );

  # The directories the janitor writes: lock files, run directories, state files, the metrics.
  janitorWritablePaths =
    {
      lockDir,
      runsDir,
      stateDir,
      metricsFile,
    }:
    [
      lockDir
      runsDir
      stateDir
    ]
    ++ (if metricsFile == null then [ ] else [ (dirOf metricsFile) ]);

  # The janitor unit's sandbox: what it must reach (the directories it writes, the cgroup file
  # system, /proc, Docker's Unix socket, signals to dead runs' processes) and nothing else.
  # systemd/ccci-run-janitor.service carries the same settings for hosts without Nix.
  # `network`: the locks are kept in etcd, reached over TCP.
  janitorHardening =
    {
      writablePaths,
      abraHome,
      network ? false,
    }:
    {
      TimeoutStartSec = "15min";
      ProtectSystem = "strict";
      ReadWritePaths = map (p: "-${p}") writablePaths ++ [
        "/sys/fs/cgroup"
        "-${abraHome}"
      ];
      ProtectHome = "read-only";
      PrivateTmp = true;
      PrivateMounts = true;
      PrivateDevices = true;
      DevicePolicy = "closed";
      NoNewPrivileges = true;
      CapabilityBoundingSet = [
        "CAP_KILL"
        "CAP_DAC_OVERRIDE"
        "CAP_SYS_PTRACE"
      ];
      ProtectKernelTunables = true;
      ProtectKernelModules = true;
      ProtectKernelLogs = true;
      ProtectClock = true;
      ProtectHostname = true;
      RestrictNamespaces = true;
      RestrictRealtime = true;
      RestrictSUIDSGID = true;
      LockPersonality = true;
      MemoryDenyWriteExecute = true;
      SystemCallArchitectures = "native";
      SystemCallFilter = [
        "@system-service"
        "~@privileged @resources @mount @swap @reboot @module @raw-io @clock @cpu-emulation @debug @obsolete"
      ];
      SystemCallErrorNumber = "EPERM";
      RestrictAddressFamilies = [ "AF_UNIX" ] ++ (if network then [ "AF_INET" "AF_INET6" ] else [ ]);
      UMask = "0077";
    }
    // (if network then { } else { IPAddressDeny = "any"; });

  # Whether a boolean setting of a unit is on, as systemd reads it (true, "yes", "on", ...).
  systemdTrue = v: any (yes: v == yes) [ true "1" "yes" "y" "true" "t" "on" ];

  # Whether a Delegate= value hands the cgroup subtree over ("yes", true, a controller list).
  delegates =
    v: !(any (no: v == no) [ false "no" "false" "off" "0" "" ]);

  # The man pages the units point at (ccci-run's package installs them).
  documentation = [
    "man:ccci-run-janitor(1)"
    "man:ccci-run(1)"
  ];
}
