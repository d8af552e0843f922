// "host:port" and "[v6 host]:port" as the cluster's conventions write them.
#pragma once

#include <cohort/host_port.h>

#include <optional>
#include <string>
#include <vector>

struct sockaddr;

namespace cohort {

// The host (brackets removed) and a port in 1..65535 (0..65535 with allowPortZero: a task that
// listens on any free port and tells its launcher); nullopt for anything else, including an IPv6
// host without brackets.
std::optional<HostPort> parseHostPort(const std::string& text, bool allowPortZero = false);

// An IPv4 or IPv6 socket address's host as text ("10.0.0.2", "fd00::2"); "" for other families.
std::string addressText(const sockaddr* address);

// True for names and addresses that mean this machine's loopback: localhost, 127.0.0.0/8, ::1
// (bare or in brackets). A name that merely starts with "127." is not one.
bool isLoopbackHost(const std::string& host);

// The address the job's other processes reach this one at, for a process that listens on every
// interface and publishes where: GLOO_SOCKET_IFNAME's address when it is set (the interface Gloo
// uses too; an unknown name throws InvalidArgument), else this machine's end of the route toward
// the rendezvous host (the source address the kernel picks, found without sending anything), else
// this host's name. Not the host's name first: Debian maps it to 127.0.1.1, and inside a network
// namespace it names the machine outside.
std::string addressTowards(const std::string& rendezvousHost, int rendezvousPort);

// GLOO_SOCKET_IFNAME's interfaces, as PyTorch reads it: a comma-separated list (Gloo spreads its
// pairs over them); empty when it is not set. Throws InvalidArgument naming one that has no
// address on this machine.
std::vector<std::string> socketInterfaces();

}  // namespace cohort
