package main

import (
	"bytes"
	"context"
	"crypto/tls"
	"crypto/x509"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"net/url"
	"os"
	"strings"
	"time"

	corev1 "k8s.io/api/core/v1"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"

	"github.com/whitesky-cloud/vco-storage/internal/cleartext"
	"github.com/whitesky-cloud/vco-storage/internal/redact"
)

// The controller keeps the map of reference_ids to locations in a ConfigMap
// of its own namespace (driver.NodeLocationsConfigMap), which the node
// DaemonSet projects into the node plugin (docs/csi-plugin.md, "Node
// location"). Two requests of the Kubernetes API, with the pod's
// ServiceAccount, are all it takes, so they are made here directly.

const saDir = "/var/run/secrets/kubernetes.io/serviceaccount"

type configMapWriter struct {
	base      string // https://host:port
	namespace string
	name      string
	tokenFile string
	hc        *http.Client
}

// inClusterConfigMap writes ConfigMap name in the pod's namespace through
// the API server the pod's environment names.
func inClusterConfigMap(name string) (*configMapWriter, error) {
	host, port := os.Getenv("KUBERNETES_SERVICE_HOST"), os.Getenv("KUBERNETES_SERVICE_PORT")
	if host == "" || port == "" {
		return nil, errors.New("--node-locations-configmap needs the Kubernetes API, and KUBERNETES_SERVICE_HOST/PORT are not set (not in a pod?)")
	}
	ns, err := os.ReadFile(saDir + "/namespace")
	if err != nil {
		return nil, fmt.Errorf("the pod's namespace: %w", err)
	}
	return newConfigMapWriter("https://"+net.JoinHostPort(host, port), strings.TrimSpace(string(ns)), name, saDir+"/token", saDir+"/ca.crt")
}

func newConfigMapWriter(base, namespace, name, tokenFile, caFile string) (*configMapWriter, error) {
	pem, err := os.ReadFile(caFile)
	if err != nil {
		return nil, fmt.Errorf("the Kubernetes API's CA: %w", err)
	}
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(pem) {
		return nil, fmt.Errorf("the Kubernetes API's CA file %s holds no PEM certificate", caFile)
	}
	tr := &http.Transport{TLSClientConfig: &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}}
	return &configMapWriter{base: base, namespace: namespace, name: name, tokenFile: tokenFile,
		hc: &http.Client{Transport: tr, Timeout: 30 * time.Second, CheckRedirect: cleartext.CheckRedirect}}, nil
}

// write replaces the ConfigMap's data with m, creating it if need be.
func (w *configMapWriter) write(ctx context.Context, m map[string]string) error {
	cm := corev1.ConfigMap{
		TypeMeta: metav1.TypeMeta{APIVersion: "v1", Kind: "ConfigMap"},
		ObjectMeta: metav1.ObjectMeta{Name: w.name, Namespace: w.namespace,
			Labels: map[string]string{"app.kubernetes.io/part-of": "vco-csi"}},
		Data: m,
	}
	body, err := json.Marshal(cm)
	if err != nil {
		return err
	}
	coll := w.base + "/api/v1/namespaces/" + url.PathEscape(w.namespace) + "/configmaps"
	code, msg, err := w.do(ctx, http.MethodPut, coll+"/"+url.PathEscape(w.name), body)
	if err == nil && code == http.StatusNotFound {
		code, msg, err = w.do(ctx, http.MethodPost, coll, body)
	}
	if err != nil {
		return fmt.Errorf("writing ConfigMap %s/%s: %w", w.namespace, w.name, err)
	}
	if code/100 != 2 {
		return fmt.Errorf("writing ConfigMap %s/%s: HTTP %d: %s; the controller's ServiceAccount needs get, create and update on that ConfigMap (deploy/manifests)", w.namespace, w.name, code, msg)
	}
	return nil
}

func (w *configMapWriter) do(ctx context.Context, method, u string, body []byte) (int, string, error) {
	tok, err := os.ReadFile(w.tokenFile) // re-read: the projected token rotates
	if err != nil {
		return 0, "", fmt.Errorf("the ServiceAccount token: %w", err)
	}
	req, err := http.NewRequestWithContext(ctx, method, u, bytes.NewReader(body))
	if err != nil {
		return 0, "", err
	}
	bearer := strings.TrimSpace(string(tok))
	req.Header.Set("Authorization", "Bearer "+bearer)
	req.Header.Set("Content-Type", "application/json")
	resp, err := w.hc.Do(req)
	if err != nil {
		return 0, "", err
	}
	defer resp.Body.Close()
	b, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
	// The answer goes into the log: a proxy's page may echo the token.
	var st metav1.Status
	if json.Unmarshal(b, &st) == nil && st.Message != "" {
		return resp.StatusCode, redact.Text(st.Message, bearer), nil
	}
	return resp.StatusCode, redact.Echo(b, 512, bearer), nil
}
