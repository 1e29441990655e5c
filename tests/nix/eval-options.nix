# nix/module.nix evaluated by the module system itself (nixpkgs' lib.evalModules) where no
# whole nixpkgs is at hand, for tests/integration/nixos.rs: `lib` is a nixpkgs `lib` directory.
# NixOS's own declarations of the options the module reads and writes are stood in for below,
# with the types NixOS gives them, so the module's option types, priorities, definitions'
# locations, assertions and warnings are the real module system's. What needs the whole of NixOS
# (the unit files it renders) is left to eval-module.nix.
# `hosts`: name -> the host's own module (a path, so errors name its file).
{
  lib,
  hosts,
}:
let
  lib' = import (/. + lib);
  inherit (lib') mkOption types;
  strings = mkOption {
    type = types.listOf types.str;
    default = [ ];
  };
  # What every unit has.
  unitOptions = {
    description = mkOption {
      type = types.str;
      default = "";
    };
    documentation = strings;
    wantedBy = strings;
  };
  fakePackage = name: {
    type = "derivation";
    inherit name;
    outPath = "/nix/store/00000000000000000000000000000000-${name}";
    meta.mainProgram = name;
  };
  # The NixOS options the module touches, declared as NixOS declares them (in kind).
  nixos =
    { ... }:
    {
      options = {
        assertions = mkOption {
          type = types.listOf types.unspecified;
          default = [ ];
        };
        warnings = strings;
        nixpkgs.config = mkOption {
          type = types.attrsOf types.anything;
          default = { };
        };
        environment.systemPackages = mkOption {
          type = types.listOf types.package;
          default = [ ];
        };
        environment.etc = mkOption {
          type = types.attrsOf (
            types.submodule {
              options.text = mkOption {
                type = types.nullOr types.lines;
                default = null;
              };
              options.source = mkOption {
                type = types.nullOr types.path;
                default = null;
              };
            }
          );
          default = { };
        };
        systemd.tmpfiles.rules = strings;
        # A user's group and home, as NixOS declares them (group "" and home /var/empty unless
        # set), with the two users NixOS itself declares on every host.
        users.users = mkOption {
          type = types.attrsOf (
            types.submodule {
              options.isSystemUser = mkOption {
                type = types.bool;
                default = false;
              };
              options.group = mkOption {
                type = types.str;
                default = "";
              };
              options.home = mkOption {
                type = types.path;
                default = "/var/empty";
              };
            }
          );
          default = { };
        };
        systemd.services = mkOption {
          type = types.attrsOf (
            types.submodule {
              options = unitOptions // {
                after = strings;
                wants = strings;
                path = mkOption {
                  type = types.listOf types.package;
                  default = [ ];
                };
                environment = mkOption {
                  type = types.attrsOf (types.nullOr (types.oneOf [ types.str types.path types.package ]));
                  default = { };
                };
                serviceConfig = mkOption {
                  type = types.attrsOf types.anything;
                  default = { };
                };
                script = mkOption {
                  type = types.lines;
                  default = "";
                };
              };
            }
          );
          default = { };
        };
        systemd.timers = mkOption {
          type = types.attrsOf (
            types.submodule {
              options = unitOptions // {
                timerConfig = mkOption {
                  type = types.attrsOf types.anything;
                  default = { };
                };
              };
            }
          );
          default = { };
        };
        services.prometheus.exporters = mkOption {
          type = types.submodule {
            options.node.extraFlags = strings;
            options.node.disabledCollectors = strings;
          };
          default = { };
        };
      };
      config.users.users = {
        root = {
          group = "root";
          home = "/root";
        };
        nobody = {
          isSystemUser = true;
          group = "nogroup";
        };
      };
      config._module.args = {
        pkgs = {
          callPackage = _: _: fakePackage "ccci-run";
          util-linux = fakePackage "util-linux";
          drone-runner-exec = fakePackage "drone-runner-exec";
        };
        utils.escapeSystemdExecArgs = lib'.concatMapStringsSep " " builtins.toJSON;
      };
    };
  evaluate =
    host:
    let
      inherit
        (lib'.evalModules {
          modules = [
            nixos
            ../../nix/module.nix
            { services.ccci-run.enable = lib'.mkDefault true; }
            host
          ];
        })
        config
        ;
      cfg = config.services.ccci-run;
      runner = if cfg.droneRunnerService == null then "drone-runner-exec" else cfg.droneRunnerService;
      service = config.systemd.services.${runner} or null;
    in
    builtins.deepSeq (removeAttrs cfg [ "package" ]) {
      failedAssertions = map (a: a.message) (lib'.filter (a: !a.assertion) config.assertions);
      inherit (config) warnings;
      janitorServiceConfig = config.systemd.services.ccci-run-janitor.serviceConfig;
      janitorTimerConfig = config.systemd.timers.ccci-run-janitor.timerConfig;
      runnerEnvironment = if service == null then null else service.environment;
      runnerServiceConfig = if service == null then null else service.serviceConfig;
      configToml = config.environment.etc."ccci-run/config.toml".text or null;
      tmpfiles = config.systemd.tmpfiles.rules;
    };
in
lib'.mapAttrs (_: evaluate) hosts
