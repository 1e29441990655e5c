# Pure helpers of the NixOS module, kept free of nixpkgs so that CI can evaluate them on their own.
{
  # The janitor's command line for the given settings.
  janitorArgs =
    { longHeld, keepRunsDays, metricsFile }:
    [ "janitor" "--long-held" (toString longHeld) ]
    ++ (if keepRunsDays == null then [ ] else [ "--keep-runs" "${toString keepRunsDays}d" ])
    ++ (if metricsFile == null then [ ] else [ "--metrics-file" metricsFile ]);

  # /etc/ccci-run/config.toml: the one place the host's paths are set. Every ccci-run on the
  # host reads it (the Drone step, the janitor's timer, an operator's shell), so they cannot drift.
  configToml =
    { lockDir, runsDir, abraHome, stateDir, docker, etcdEndpoints ? [ ], leaseTtl ? 10 }:
    ''
      # Written by the NixOS module services.ccci-run; `ccci-run config` shows what is in force.
      lock_dir = "${lockDir}"
      runs_dir = "${runsDir}"
      abra_home = "${abraHome}"
      state_dir = "${stateDir}"
      docker = "${docker}"
    '' + (if etcdEndpoints == [ ] then "" else ''
      etcd_endpoints = [ ${builtins.concatStringsSep ", " (map (e: "\"${e}\"") etcdEndpoints)} ]
      lease_ttl = ${toString leaseTtl}
    '');

  # The janitor unit's sandbox: what it must reach (the directories it writes, the cgroup file
  # system, /proc, Docker's Unix socket, signals to dead runs' processes) and nothing else.
  # systemd/ccci-run-janitor.service carries the same settings for hosts without Nix.
  # `network`: the locks are kept in etcd, reached over TCP.
  janitorHardening =
    { writablePaths, abraHome, network ? false }:
    {
      TimeoutStartSec = "15min";
      ProtectSystem = "strict";
      ReadWritePaths = map (p: "-${p}") writablePaths ++ [ "/sys/fs/cgroup" "-${abraHome}" ];
      ProtectHome = "read-only";
      PrivateTmp = true;
      PrivateMounts = true;
      PrivateDevices = true;
      DevicePolicy = "closed";
      NoNewPrivileges = true;
      CapabilityBoundingSet = [ "CAP_KILL" "CAP_DAC_OVERRIDE" ];
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
    } // (if network then { } else { IPAddressDeny = "any"; });
}
