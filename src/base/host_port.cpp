#include "base/host_port.h"

#include <cohort/error.h>

#include <arpa/inet.h>
#include <ifaddrs.h>
#include <netdb.h>
#include <sys/socket.h>
#include <unistd.h>

#include <charconv>
#include <cstdlib>

namespace cohort {

std::string HostPort::str() const {
  const bool v6 = host.find(':') != std::string::npos && host.front() != '[';
  return (v6 ? "[" + host + "]" : host) + ":" + std::to_string(port);
}

std::optional<HostPort> parseHostPort(const std::string& text, bool allowPortZero) {
  std::string host;
  std::string port;
  if (!text.empty() && text.front() == '[') {
    const size_t close = text.find("]:");
    if (close == std::string::npos) return std::nullopt;
    host = text.substr(1, close - 1);
    port = text.substr(close + 2);
  } else {
    const size_t colon = text.rfind(':');
    if (colon == std::string::npos) return std::nullopt;
    host = text.substr(0, colon);
    port = text.substr(colon + 1);
    if (host.find(':') != std::string::npos) return std::nullopt;  // IPv6 needs brackets
  }
  if (host.empty() || port.empty() || port.size() > 5) return std::nullopt;
  int value = 0;
  const auto [ptr, ec] = std::from_chars(port.data(), port.data() + port.size(), value);
  if (ec != std::errc() || ptr != port.data() + port.size() || value < (allowPortZero ? 0 : 1) || value > 65535) return std::nullopt;
  return HostPort{host, value};
}

std::string addressText(const sockaddr* address) {
  char text[INET6_ADDRSTRLEN] = {};
  if (address->sa_family == AF_INET) {
    ::inet_ntop(AF_INET, &reinterpret_cast<const sockaddr_in*>(address)->sin_addr, text, sizeof(text));
  } else if (address->sa_family == AF_INET6) {
    ::inet_ntop(AF_INET6, &reinterpret_cast<const sockaddr_in6*>(address)->sin6_addr, text, sizeof(text));
  }
  return text;
}

bool isLoopbackHost(const std::string& host) {
  if (host == "localhost" || host == "::1" || host == "[::1]") return true;
  in_addr a4{};
  return ::inet_pton(AF_INET, host.c_str(), &a4) == 1 && (ntohl(a4.s_addr) >> 24) == 127;
}

namespace {

// The interface's IPv4 address, else its first IPv6 one that is not link-local; "" if none.
std::string interfaceAddress(const std::string& name) {
  ifaddrs* list = nullptr;
  if (::getifaddrs(&list) != 0) return "";
  std::string v4, v6;
  for (const ifaddrs* i = list; i != nullptr; i = i->ifa_next) {
    if (i->ifa_addr == nullptr || name != i->ifa_name) continue;
    if (i->ifa_addr->sa_family == AF_INET && v4.empty()) v4 = addressText(i->ifa_addr);
    if (i->ifa_addr->sa_family == AF_INET6 && v6.empty() &&
        !IN6_IS_ADDR_LINKLOCAL(&reinterpret_cast<const sockaddr_in6*>(i->ifa_addr)->sin6_addr)) {
      v6 = addressText(i->ifa_addr);
    }
  }
  ::freeifaddrs(list);
  return v4.empty() ? v6 : v4;
}

// connect() on a datagram socket only chooses the route and the source address; nothing is sent.
std::string routeSource(const std::string& host, int port) {
  addrinfo hints{};
  hints.ai_socktype = SOCK_DGRAM;
  addrinfo* found = nullptr;
  if (::getaddrinfo(host.c_str(), std::to_string(port).c_str(), &hints, &found) != 0) return "";
  std::string source;
  for (const addrinfo* ai = found; ai != nullptr && source.empty(); ai = ai->ai_next) {
    const int fd = ::socket(ai->ai_family, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) continue;
    sockaddr_storage local{};
    socklen_t len = sizeof(local);
    if (::connect(fd, ai->ai_addr, ai->ai_addrlen) == 0 &&
        ::getsockname(fd, reinterpret_cast<sockaddr*>(&local), &len) == 0) {
      source = addressText(reinterpret_cast<const sockaddr*>(&local));
    }
    ::close(fd);
  }
  ::freeaddrinfo(found);
  return source;
}

}  // namespace

std::vector<std::string> socketInterfaces() {
  const char* value = std::getenv("GLOO_SOCKET_IFNAME");
  std::vector<std::string> names;
  if (value == nullptr) return names;
  const std::string text = value;
  for (size_t at = 0; at <= text.size();) {
    size_t end = text.find(',', at);
    if (end == std::string::npos) end = text.size();
    if (end > at) names.push_back(text.substr(at, end - at));
    at = end + 1;
  }
  for (const std::string& name : names) {
    COHORT_CHECK(!interfaceAddress(name).empty(), InvalidArgument, "GLOO_SOCKET_IFNAME=", text, ": ", name,
                 " is no interface with an address on this machine: name ones `ip -brief addr` lists, or unset it");
  }
  return names;
}

std::string addressTowards(const std::string& rendezvousHost, int rendezvousPort) {
  if (const std::vector<std::string> interfaces = socketInterfaces(); !interfaces.empty()) {
    return interfaceAddress(interfaces.front());
  }
  if (const std::string source = routeSource(rendezvousHost, rendezvousPort);
      !source.empty() && !isLoopbackHost(source)) {
    return source;
  }
  char name[256] = {};
  ::gethostname(name, sizeof(name) - 1);
  return name;
}

}  // namespace cohort
